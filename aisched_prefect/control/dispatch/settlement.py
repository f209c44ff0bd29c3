"""Settling a run exactly once: what it used, per account it holds, and the evidence of how it ended."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import cloudpickle

from aisched_prefect.control.admission import stages
from aisched_prefect.control.admission.record import Admission
from aisched_prefect.control.outcomes import direct_reply, result_evidence
from aisched_prefect.control.dispatch.outlast import outlasting
from aisched_prefect.control.dispatch.running import Preempted, Running, base_payload, held_by_account
from aisched_prefect.control.dispatch.time_limit import TimeLimitRequeue, stop_reply
from dask_gpu.policies.time_limits import TIME_LIMIT
from aisched_prefect.errors import InvalidUsage, LedgerUnavailable
from aisched_prefect.ledger import BudgetAlert, Hold
from aisched_prefect.usage import ReportedUsage, reported
from aisched_prefect.wire import Reply
from blocks import MAX_AMOUNT, BudgetBlock, UnpriceableRequest, Usage
from dask_gpu.worker.records import Outcome

logger = logging.getLogger("aisched_prefect.control")


class Settlement:
    """The dispatcher's part that prices and settles runs (a mixin of Dispatcher: its ledger, state, settings)."""

    def keep_warm(self, adm: Admission) -> float:
        """How long a run's body may wait warm for the next run of its key: what the task declared, at most the plane's
        setting; 0 for runs the queue does not place on one host (preemptible, multi-host) or with the queue off."""
        req = adm.request
        if not self.queue or req.preemptible or (req.hosts or 1) > 1 or req.gpus <= 0:
            return 0.0
        keep = min(req.keep_warm_seconds, self.settings.max_keep_warm_seconds)
        return keep if adm.keep_warm_seconds is None else min(keep, adm.keep_warm_seconds)  # cut to fit its cap

    def _bound(self, admission: Admission) -> stages.Bound:
        snap = self.state.snapshot
        cred = snap.credentials.get(admission.credential)
        if cred is None:  # a credential is never removed from the chain, only marked revoked
            raise RuntimeError(f"credential {admission.credential} is unknown")
        return stages.configuration(snap, cred)

    def charges(self, admission: Admission, gpu_type: str | None, seconds: float, reported: ReportedUsage | None,
                holds: list[Hold]) -> dict[str, float]:
        """What a run used, per account it holds: GPU time at its real type, reported (else estimated) tokens.

        Accounts for GPU types it did not land on get nothing (their holds are voided).
        """
        bound = self._bound(admission)
        budget: BudgetBlock = bound.budget.model
        request = admission.request
        tokens = reported.tokens if reported is not None else request.est_tokens
        money = budget.actual_cost(request.gpus, seconds, gpu_type)
        if reported is not None and reported.cost is not None:
            money += reported.cost
        elif tokens:
            try:
                money += tokens / 1000 * budget.token_price(request.model or "*")
            except UnpriceableRequest:  # reported tokens of a model the budget cannot price: charge the hold
                return held_by_account(holds)
        used = Usage(money=money, gpu_hours=request.gpus * seconds / 3600, tokens=tokens)
        facts = admission.facts.model_copy(update={"gpu_types": (gpu_type,)}) if gpu_type else admission.facts
        # Above MAX_AMOUNT no ledger books it; above its holds a charge posts only what the budgets have left anyway.
        lines = stages.lines(bound, facts, used, admission.shares, self.ledger.now())
        return {line.budget: min(line.amount, MAX_AMOUNT) for line in lines}

    def settle(self, running: Running | Admission, charges: dict[str, float] | None, payload: dict[str, Any]) -> None:
        adm = running.admission if isinstance(running, Running) else running
        if isinstance(running, Running):
            with running.holds_lock:  # a top-up taken now would be left pending, then expire charged in full
                running.settled = True
                holds = list(running.holds)
                covered = running.covered_seconds
            # Read under the lock: a top-up taken while the caller built its payload counts.
            payload = {**payload, "top_ups": len(holds) - len(adm.holds), "covered_seconds": covered}
            if running.model_limit is not None:
                payload = {**payload, "model_limit": running.model_limit}
        else:
            holds = adm.holds
        if not holds:  # nothing covered it (a budget with prices only): its settlement is still one record
            self._outlasting(lambda: self.ledger.record("settlement", {**base_payload(adm), **payload,
                                                                       "settlements": []}, **adm.ids), adm)
            return
        self._outlasting(lambda: self.ledger.settle([h.id for h in holds], charges, kind="settlement",
                                                    payload={**base_payload(adm), **payload}, **adm.ids), adm)

    def _outlasting(self, write: Callable[[], Any], adm: Admission) -> None:
        """Run a settlement's write, again while the ledger's database is unreachable, for up to
        AISCHED_SETTLE_PATIENCE_SECONDS (at most half the hold lease): control.outlast, the piece a warm body's idle
        settlement uses too.

        While it waits the run stays among the dispatcher's running runs, whose holds the watcher renews once the
        database is back, so no hold expires (charged in full) under a run that finished; and the reply waits with
        it, so the flow hears how the run ended, not "could not run it"."""
        outlasting(write, patience=self.settle_patience(), what=f"AI task {adm.task_name} (admission {adm.id}) ended")

    def settle_patience(self) -> float:
        """How long a settlement keeps trying through a ledger outage: the setting, at most half the hold lease."""
        return min(self.settings.settle_patience_seconds, self.settings.hold_lease_seconds / 2)

    def _finish(self, state: Running, out: Outcome, members: list[dict[str, Any]] | None = None) -> tuple[Reply, bytes]:
        adm, run = state.admission, out.run
        stopped = None
        if out.stopped:
            stopped = state.stop_reason or ("preempted" if state.preempted_for is not None else "lease")
        try:
            usage, bad_usage = reported(out.reports), None
        except InvalidUsage as exc:  # a body that reported around report_usage(): its word settles nothing
            usage, bad_usage = None, exc
        if bad_usage is None:
            charges = self.charges(adm, run.gpu_type, run.seconds, usage, state.holds)
            outcome = "completed" if out.ok else TIME_LIMIT if stopped == TIME_LIMIT else \
                f"stopped-{stopped}" if stopped else "failed"
        else:  # what it used is unknown: charge what it held, and return no result
            charges, outcome, stopped = held_by_account(state.holds), "failed", None
            out = out.model_copy(update={"ok": False, "error_type": "aisched_prefect.errors.InvalidUsage",
                                         "error_message": str(bad_usage), "error_text": str(bad_usage),
                                         "error": cloudpickle.dumps(bad_usage), "value": b""})
        placement = {"worker": run.worker, "name": run.name, "host": run.host, "devices": run.device_keys,
                     "gpu_type": run.gpu_type,
                     "source": run.source, **({"slurm_job": run.slurm_job} if run.slurm_job else {}),
                     **({"queue_plan": state.placement.plan} if state.placement and state.placement.plan else {}),
                     "live": None if run.live is None else {k: v.model_dump() for k, v in run.live.items()}}
        if members:  # a multi-host run: every member, where it ran and on which devices
            placement.update(workers=[m["worker"] for m in members], members=members,
                             devices=[f"{m['name'] or m['worker']}/{d}" for m in members for d in m["devices"]])
        self.settle(state, charges, {
            "outcome": outcome, "error": None if out.ok else f"{out.error_type}: {out.error_message}",
            "stopped": out.stopped, "placement": placement, "seconds": run.seconds,
            "gpu_seconds": run.seconds * len(run.devices),
            "usage": usage.model_dump() if usage else None,
            "charges": charges, **({"preempted_for": state.preempted_for} if stopped == "preempted" else {}),
            **({"body": out.body.model_dump()} if out.body is not None else {}),
            **(result_evidence(out.value, out.result) if out.ok else {})})
        if out.body is not None and not members:  # a warm body's idle time: booked, and the one before settled
            self.warm.started(adm, out.body.model_dump(), run.gpu_type, run.worker)
            if out.body.kept and not adm.request.keep_warm_across_flow_runs:
                self.warm_tail.after()  # it ends once nothing of its key waits in its flow run (control.dispatch.warm_tail)
        if stopped == "preempted":
            logger.warning("AI task %s was preempted after %.1fs to give tenant %r its quota back; charged for that "
                           "and queued again", adm.task_name, run.seconds, state.preempted_for)
            raise Preempted()
        if stopped == TIME_LIMIT and adm.request.requeue_on_time_limit:
            logger.warning("AI task %s stopped at its time limit after %.1fs; charged for that and queued again "
                           "(requeue_on_time_limit)", adm.task_name, run.seconds)
            raise TimeLimitRequeue(run.seconds)
        common = {"admission": adm.id, "logs": out.logs, "placement": placement, "charged": charges}
        if stopped == TIME_LIMIT:
            return Reply(status="stopped", **stop_reply(adm, run.seconds, self.settings), **common), b""
        if stopped == "budget":
            return Reply(status="denied", stage="budget", reason=(
                f"the task ran {run.seconds:.1f}s, all its budget holds cover ({state.covered_seconds:.1f}s), and a "
                f"top-up was refused ({state.top_up_refused}); it was stopped and charged for what ran"),
                fix="raise est_seconds, or the budget limit, or the grant's max cost", **common), b""
        if stopped == "revoked":
            return Reply(status="denied", stage="revocation", reason=(
                f"a grant in the chain {adm.chain} was revoked, deleted or expired while the task ran; it was stopped "
                f"after {run.seconds:.1f}s and charged for that"), fix="ask for a new grant", **common), b""
        if stopped:
            return Reply(status="stopped", reason=out.stopped or "", error_message=f"stopped: {out.stopped}",
                         error_type="dask_gpu.errors.StopRequested", **common), b""
        if not out.ok:
            return Reply(status="failed", error_type=out.error_type, error_message=out.error_message,
                         error_text=out.error_text, **common), out.error
        return Reply(status="completed", **direct_reply(out.result), **common), out.value


ALERT_EVENT = "aisched.budget.threshold-crossed"


def emit_budget_alert(alert: BudgetAlert) -> None:
    """A budget crossed 50/80/100% of its limit: a log line, and a Prefect event automations can act on.

    The ledger calls this after the write that crossed it commits; an alert that
    cannot be sent never fails that write. No event without PREFECT_API_URL
    (emitting would start a temporary Prefect server inside the control plane).
    """
    logger.warning("budget %r (%s, %s) is at %.0f%% of its limit %.2f: crossed %d%%", alert.budget, alert.period,
                   alert.unit, alert.used * 100, alert.limit, alert.threshold)
    if not os.environ.get("PREFECT_API_URL"):
        return
    try:
        from prefect.events import emit_event

        emit_event(event=ALERT_EVENT, resource={
            "prefect.resource.id": f"aisched.budget.{alert.budget}", "prefect.resource.name": alert.budget,
            "aisched.period": alert.period, "aisched.unit": alert.unit, "aisched.threshold": str(alert.threshold),
        }, payload=alert.model_dump())
    except Exception:
        logger.exception("could not emit the budget alert event")

