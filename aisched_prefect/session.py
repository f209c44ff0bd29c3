"""One flow run's admission session: the loaded blocks, the ledger, the Dask client.

The runner opens a session when the flow run enters it and closes it at the
end; nothing here is shared between flow runs. Every AI task call goes
through `RunnerSession.run`: feasibility, pricing, authority, approval policy,
budget holds on every account that covers the run (+ evidence, one
transaction), person approval if asked, Dask with resource annotations and a
ticket, then settlement (+ evidence, one transaction). The Prefect task engine
itself stays in the flow process, so the worker only sees the user function:
no Prefect context is serialized per task.

One watcher thread per session keeps running work honest: it stops tasks
whose grant was revoked or expired, renews the leases of live holds, and
tops up a GPU task's hold before it runs past what the hold covers (stopping
it cleanly at the cover if the top-up is refused).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from distributed import Client, Future, KilledWorker
from pydantic import BaseModel, ConfigDict

from aisched_prefect.approval_desk import ApprovalDesk
from aisched_prefect.approvals import ApprovalRequest, Approver, PolicyApprover, PrefectPauseApprover, approval_digest
from aisched_prefect.config import RunnerConfig
from aisched_prefect.errors import AdmissionDenied, ApprovalSuspended, TicketRejected
from aisched_prefect.evidence import EvidenceRecord
from aisched_prefect.ledger import BudgetAlert, BudgetExceeded, Hold, Ledger
from aisched_prefect.report import evidence_rows
from aisched_prefect.request import AIRequest
from aisched_prefect.tickets import AdmissionTicket, TicketSigner
from aisched_prefect.usage import ReportedUsage
from aisched_prefect.worker import WorkerOutcome, run_admitted
from blocks import (
    ApprovalPolicyBlock,
    AuthorityBlock,
    BudgetBlock,
    BudgetLine,
    ChainBroken,
    ClusterBlock,
    Grant,
    ModelLimit,
    RunFacts,
    UnpriceableRequest,
    Usage,
    authorize,
    resolve_chain,
    utc,
)
from dask_gpu import (
    InfeasibleRequest,
    StopRequested,
    LocalGPUCluster,
    WorkerInventory,
    cluster_inventories,
    eligible_workers,
    install_queue,
    request_stop,
    running_for,
    worker_restriction,
)

logger = logging.getLogger("aisched_prefect")

ARTIFACT_KEY = "aisched-evidence"
INVENTORY_TTL_SECONDS = 5.0
REVOCATION_POLL_SECONDS = 0.5
BLOCK_TTL_SECONDS = 5.0
TOP_UP_AT = 0.8  # ask for a top-up when a GPU task has used this share of the time its holds cover
ALERT_EVENT = "aisched.budget.threshold-crossed"


class Admission(BaseModel):
    """What admission hands to execution: the ticket, where the run may go, what it holds."""

    model_config = ConfigDict(frozen=True)

    ticket: AdmissionTicket
    workers: list[str]
    holds: list[Hold]
    reserved: float
    priced_type: str | None
    chain: list[str]
    expires_at: float | None  # the earliest expiry in the chain: expiry stops the run like revocation
    facts: RunFacts
    shares: dict[str, float] = {}  # grant id -> budget_share, for grants of the chain that cap their share
    priority: int = 0  # the request's priority, capped by every grant of its chain


@dataclass
class _Running:
    """One AI task between submission and settlement, as the watcher thread sees it."""

    request: AIRequest
    admission: Admission
    payload: dict[str, Any]
    ids: dict[str, Any]
    holds: list[Hold]
    covered_seconds: float  # runtime its holds pay for; grows with each top-up
    submitted: float  # monotonic
    extra_cost: float = 0.0  # money held by top-ups
    started_at: float | None = None  # monotonic, when its worker gave it devices (asked only once it matters)
    top_up_refused: str | None = None
    stop_reason: str | None = None
    queue_id: str | None = None  # its key in the cluster's queue (runner queue=True), until it leaves
    preempted_for: str | None = None  # the tenant the cluster's queue stopped it for, as it left the queue
    placed: bool = False
    asked: set[float] = field(default_factory=set)


class _Preempted(Exception):
    """The cluster's queue stopped a run to give borrowed GPUs back; it was charged and will queue again."""


def _version(model: BaseModel) -> str:
    """Short content hash: which version of a grant or policy decided, as the evidence records it."""
    return hashlib.sha256(model.model_dump_json().encode()).hexdigest()[:12]


def _load(value: Any, cls: type, what: str) -> Any:
    if value is None or isinstance(value, cls):
        return value
    try:
        return cls.load(value)
    except ValueError as exc:
        raise AdmissionDenied(
            "configuration", f"{what} block {value!r} could not be loaded ({exc})",
            f"create it: {cls.__name__}(...).save({value!r}), or edit the runner's {what}= argument",
        ) from None


class RunnerSession:
    """Open resources for one flow run; `run` admits and executes one AI task call."""

    def __init__(self, config: RunnerConfig) -> None:
        self.config = config
        self.authority: AuthorityBlock = _load(config.authority, AuthorityBlock, "authority")
        self._authority_read_at = time.monotonic()
        self.budget: BudgetBlock = _load(config.budget, BudgetBlock, "budget")
        self.policy: ApprovalPolicyBlock | None = _load(config.approval_policy, ApprovalPolicyBlock, "approval_policy")
        self.cluster_settings: ClusterBlock | None = _load(config.cluster, ClusterBlock, "cluster")
        self._declare_model_limits()
        self.authority_name = config.authority if isinstance(config.authority, str) else "inline"
        self.budget_name = config.budget if isinstance(config.budget, str) else "inline"
        self.approver: Approver = (
            PrefectPauseApprover() if config.approver == "pause"
            else PolicyApprover() if config.approver == "policy" else config.approver
        )
        self.desk = ApprovalDesk(self.approver, self._approver_grant, lambda: self.authority.approver_keys,
                                 config.approval_hook, on_batch=self._record_batch)
        self.ledger = Ledger(config.ledger_url, lease_seconds=config.hold_lease_seconds, on_alert=self._alert)
        self.tenant = config.tenant or config.principal.split("/")[0]
        self.cluster: LocalGPUCluster | None = None
        try:
            if config.address:
                self.client = Client(config.address, set_as_default=False)
            else:
                self.cluster = LocalGPUCluster(declared=config.declared)
                self.client = Client(self.cluster, set_as_default=False)
            self._refresh_inventories()
            if config.queue:
                install_queue(self.client, weights=self.cluster_settings.tenant_weights if self.cluster_settings else None)
            self.signer = TicketSigner()
            self.signer.register(self.client)
        except BaseException:
            self.close()
            raise
        self.flow_run_ids: set[str] = set()
        self._versions_seen: set[tuple[str, str]] = set()
        # AI tasks between submission and settlement (Dask key -> state), holds to keep leased, and the watcher.
        self._running: dict[str, _Running] = {}
        self._live_holds: set[str] = set()
        self._running_lock = threading.Lock()
        self._closing = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="aisched-watch", daemon=True)
        self._watcher.start()

    def _alert(self, alert: BudgetAlert) -> None:
        """A budget crossed 50/80/100%: a log line, and a Prefect event automations can act on."""
        logger.warning("budget %r (%s, %s) is at %.0f%% of its limit %.2f: crossed %d%%", alert.budget, alert.period,
                       alert.unit, alert.used * 100, alert.limit, alert.threshold)
        try:
            from prefect.events import emit_event

            emit_event(event=ALERT_EVENT, resource={
                "prefect.resource.id": f"aisched.budget.{alert.budget}", "prefect.resource.name": alert.budget,
                "aisched.period": alert.period, "aisched.unit": alert.unit, "aisched.threshold": str(alert.threshold),
            }, payload=alert.model_dump())
        except Exception:  # an alert that cannot be sent must not fail the ledger write that caused it
            logger.exception("could not emit the budget alert event")

    def _watch(self) -> None:
        """Every REVOCATION_POLL_SECONDS: revocation and expiry stops, budget top-ups and caps, hold leases."""
        renewed_at = time.monotonic()
        while not self._closing.wait(REVOCATION_POLL_SECONDS):
            try:
                with self._running_lock:
                    running = dict(self._running)
                if running:
                    self._stop_revoked(running)
                    self._enforce_cover(running)
                if time.monotonic() - renewed_at >= self.config.hold_lease_seconds / 3:
                    with self._running_lock:
                        live = list(self._live_holds)
                    lost = set(live) - self.ledger.renew(live)
                    with self._running_lock:
                        lost &= self._live_holds
                    if lost:
                        logger.warning("%d hold(s) were no longer pending when renewed (expired or settled)", len(lost))
                    renewed_at = time.monotonic()
            except Exception:  # keep watching; the next poll retries
                logger.exception("watcher failed; retrying")

    def _stop(self, keys: list[str], reason: str) -> None:
        queued = []
        with self._running_lock:
            for k in keys:
                if k in self._running:
                    self._running[k].stop_reason = reason
                    if self._running[k].queue_id is not None and not self._running[k].placed:
                        queued.append(self._running[k].queue_id)
        for queue_id in queued:  # still in the cluster's queue: take it out, its wait returns no worker
            self.client.sync(self.client.scheduler.gpu_queue_leave, id=queue_id)
        request_stop(self.client, keys)

    def _stop_revoked(self, running: dict[str, _Running]) -> None:
        """Stop running (and queued) tasks whose chain holds a revoked or expired grant."""
        _, revoked = self._authority_now()  # revoked in the ledger or the block; expiry below
        now = time.time()
        victims = [k for k, r in running.items() if r.stop_reason is None
                   and (revoked.intersection(r.admission.chain)
                        or (r.admission.expires_at is not None and now >= r.admission.expires_at))]
        if victims:
            self._stop(victims, "revoked")
            logger.warning("grant revoked: stopping %d running AI task(s)", len(victims))

    def _enforce_cover(self, running: dict[str, _Running]) -> None:
        """Top up GPU tasks nearing the end of their cover; stop those refused once they reach it.

        A task cannot have run longer than it was submitted, so its start is
        asked from the workers only once it was submitted long enough ago to
        near its cover: short tasks cost no round trip at all.
        """
        now = time.monotonic()
        unknown = [k for k, r in running.items() if r.started_at is None and r.stop_reason is None and r.request.gpus
                   and now - r.submitted >= TOP_UP_AT * r.covered_seconds]
        if unknown:
            for key, seconds in running_for(self.client, unknown).items():
                running[key].started_at = now - seconds
        for key, r in running.items():
            if r.started_at is None or r.stop_reason is not None or not r.request.gpus:
                continue
            elapsed = now - r.started_at
            if r.top_up_refused is None and elapsed >= TOP_UP_AT * r.covered_seconds:
                self._top_up(r)
            if r.top_up_refused is not None and elapsed >= r.covered_seconds:
                logger.warning("AI task %s reached the %.1fs its budget holds cover; stopping it (%s)",
                               r.payload["task"], r.covered_seconds, r.top_up_refused)
                self._stop([key], "budget")

    def _top_up(self, r: _Running) -> None:
        """Hold more for a running GPU task, through the same authority, policy and budget checks."""
        request, adm = r.request, r.admission
        extra = request.est_seconds * self.config.top_up_fraction
        hour_price = self.budget.gpu_hour_price(adm.priced_type) if adm.priced_type else 0.0
        usage = Usage(money=request.gpus * extra / 3600 * hour_price, gpu_hours=request.gpus * extra / 3600)
        total = adm.facts.model_copy(update={"est_seconds": r.covered_seconds + extra,
                                             "est_cost": (adm.facts.est_cost or 0) + r.extra_cost + usage.money})
        payload = {**r.payload, "top_up": {"seconds": extra, "covered_before": r.covered_seconds,
                                           "cost": usage.money, "total_cost": total.est_cost}}
        why = None
        chain, refusal = self._authorize(total)
        if chain is None:
            why = f"authority: {refusal}"
        elif self.policy is not None:
            outcome = self.policy.evaluate(total)
            if outcome.action == "deny":
                why = f"approval policy rule {outcome.rule!r} denies a run this large"
            elif outcome.action == "ask":
                why = (f"approval policy rule {outcome.rule!r} asks a person for a run this large, and a running task "
                       "cannot wait for one; declare est_seconds that covers the run so it is approved at admission")
        if why is None:
            try:
                held, _ = self.ledger.reserve(self._lines(adm.facts, usage, adm.shares),
                                              kind="top-up", payload=payload, **r.ids)
            except BudgetExceeded as exc:
                why = f"budget: {exc}"
            else:
                with self._running_lock:
                    r.holds.extend(held)
                    self._live_holds.update(h.id for h in held)
                r.covered_seconds += extra
                r.extra_cost += usage.money
                return
        r.top_up_refused = why
        self.ledger.record("top-up-refused", {**payload, "reason": why}, **r.ids)

    def close(self) -> None:
        watcher = getattr(self, "_watcher", None)
        if watcher is not None:
            self._closing.set()
            watcher.join(timeout=5)
        try:
            self._publish_artifacts()
        finally:
            client = getattr(self, "client", None)
            if client is not None:
                if getattr(self, "signer", None) is not None:
                    self.signer.unregister(client)
                client.close()
            if self.cluster is not None:
                self.cluster.close()
            self.ledger.close()

    # -- admission ------------------------------------------------------------------
    def _refresh_inventories(self) -> None:
        self.inventories: dict[str, WorkerInventory] = cluster_inventories(self.client)
        self._inventories_read_at = time.monotonic()

    def _placement(self, request: AIRequest) -> list[str]:
        """Workers that could hold the request, from an inventory at most INVENTORY_TTL old.

        Feasibility follows the cluster: workers that joined are seen within the
        TTL, and an infeasible answer is always re-checked against a fresh read.
        """
        if time.monotonic() - self._inventories_read_at > INVENTORY_TTL_SECONDS:
            self._refresh_inventories()
        gpu_request = request.gpu_request()
        try:
            return eligible_workers(gpu_request, self.inventories)
        except InfeasibleRequest:
            self._refresh_inventories()
            return eligible_workers(gpu_request, self.inventories)

    def _roots(self) -> dict[str, Grant]:
        """Root grants, re-read from the AuthorityBlock at most every BLOCK_TTL_SECONDS (edits in the UI apply)."""
        if isinstance(self.config.authority, str) and time.monotonic() - self._authority_read_at > BLOCK_TTL_SECONDS:
            self.authority = _load(self.config.authority, AuthorityBlock, "authority")
            self._authority_read_at = time.monotonic()
        return {g.id: g for g in self.authority.grants}

    def _authority_now(self) -> tuple[dict[str, Grant], set[str]]:
        """Root grants with every revocation applied, and every revoked id (ledger, or flagged in the block).

        The one place admission, approval and the revocation watcher learn what is revoked.
        """
        roots = self._roots()
        revoked = self.ledger.revoked_ids() | {gid for gid, g in roots.items() if g.revoked}
        return {gid: g.model_copy(update={"revoked": True}) if gid in revoked and not g.revoked else g
                for gid, g in roots.items()}, revoked

    def _authorize(self, facts: RunFacts) -> tuple[list[Grant] | None, str]:
        """The chain of grants, root first, that authorizes this run; or None and why not.

        Revocations are read from the ledger on every admission, so one applies
        to the next admission at once and cascades down every chain through it.
        With `grant=` the run acts under exactly that grant's chain; without it,
        under the first root grant for the principal that covers it.
        """
        roots, revoked = self._authority_now()
        if self.config.grant is None:
            decision = authorize(list(roots.values()), facts)
            return ([decision.grant], "") if decision.grant else (None, "; ".join(decision.reasons))
        try:
            chain = resolve_chain(self.config.grant, roots, self.ledger.delegated_grants(), revoked)
        except ChainBroken as exc:
            return None, f"grant chain of {self.config.grant!r} is broken: {exc}"
        leaf = chain[-1]
        if not leaf.covers_principal(facts.principal):
            return None, f"grant {leaf.id!r} is for {leaf.principal!r}, not for principal {facts.principal!r}"
        why = leaf.refusal(facts)
        return (chain, "") if why is None else (None, why)

    def _deny(self, stage: str, reason: str, fix: str, payload: dict[str, Any], ids: dict[str, Any]) -> AdmissionDenied:
        self.ledger.record("denial", {**payload, "stage": stage, "reason": reason, "fix": fix}, **ids)
        return AdmissionDenied(stage, reason, fix)

    def run(self, fn: Callable[..., Any], request: AIRequest, args: tuple[Any, ...], kwargs: dict[str, Any],
            *, task_name: str, task_run_id: str, flow_run_id: str, flow_name: str | None = None,
            flow_version: str | None = None, run_key: str | None = None) -> Any:
        """Admit one call of an AI task, run it on its devices, settle it; return its result.

        `run_key` names the task within its flow run across re-runs (flow run, task key): the
        approval digest binds to it, not to the task run id, which a resumed suspended run changes.
        """
        self.flow_run_ids.add(flow_run_id)
        ids = {"flow_run_id": flow_run_id, "task_run_id": task_run_id, "principal": self.config.principal}
        payload: dict[str, Any] = {
            "task": task_name, "flow": flow_name, "tenant": self.tenant, "request": request.model_dump(),
            "authority": self.authority_name,
            "budget": self.budget_name, "policy": self.config.approval_policy if isinstance(self.config.approval_policy, str) else None,
        }
        admission = self._admit(request, payload, ids, (flow_name, flow_version), (args, kwargs),
                                run_key or f"{flow_run_id}/{task_run_id}")
        with ExitStack() as stack:
            try:
                stack.enter_context(self._model_slot(request, payload))
            except BaseException as exc:  # never started: release what admission held
                self._settle(admission.holds, None, kind="settlement",
                             payload={**payload, "outcome": "not-started", "error": f"{type(exc).__name__}: {exc}"}, ids=ids)
                raise
            return self._execute(fn, request, args, kwargs, admission, payload, ids, task_name)

    # -- model-call limits ----------------------------------------------------------
    def _model_limit(self, request: AIRequest) -> ModelLimit | None:
        if request.kind != "model-call" or self.cluster_settings is None:
            return None
        return self.cluster_settings.limit_for(request.model)

    def _declare_model_limits(self) -> None:
        """Create or update one Prefect global concurrency limit per model limit (shared by all flow runs)."""
        if self.cluster_settings is None or not self.cluster_settings.model_limits:
            return
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            for lim in self.cluster_settings.model_limits:
                if lim.concurrency is not None:
                    client.upsert_global_concurrency_limit_by_name(f"{lim.slug}-concurrency", lim.concurrency)
                if lim.per_minute is not None:  # one slot, refilled per_minute/60 times a second: evenly spaced
                    client.upsert_global_concurrency_limit_by_name(f"{lim.slug}-rate", 1, lim.per_minute / 60.0)

    @contextmanager
    def _model_slot(self, request: AIRequest, payload: dict[str, Any]) -> Iterator[None]:
        """Wait for the model's rate and concurrency limits (admitted runs only), hold the slot while it runs.

        Prefect's global concurrency limits keep the count on the server, so
        every flow run and host shares it, and a dead holder's slot comes back
        when its lease runs out.
        """
        lim = self._model_limit(request)
        if lim is None:
            yield
            return
        from prefect.concurrency.sync import concurrency, rate_limit

        t0 = time.monotonic()
        if lim.per_minute is not None:
            rate_limit(f"{lim.slug}-rate", occupy=1, strict=True)
        if lim.concurrency is None:
            payload["model_limit"] = {"limit": lim.model, "waited": time.monotonic() - t0}
            yield
            return
        with concurrency(f"{lim.slug}-concurrency", occupy=1, strict=True):
            payload["model_limit"] = {"limit": lim.model, "waited": time.monotonic() - t0}
            yield

    def _admit(self, request: AIRequest, payload: dict[str, Any], ids: dict[str, Any],
               flow: tuple[str | None, str | None] = (None, None),
               call: tuple[tuple[Any, ...], dict[str, Any]] = ((), {}), run_key: str = "") -> Admission:
        """Feasibility, pricing, authority, policy, budget hold, then a person if the policy asks."""
        gpu_request = request.gpu_request()
        try:
            workers = self._placement(request)
        except InfeasibleRequest as exc:
            raise self._deny("feasibility", str(exc), "ask for what some worker has, or add such a worker", payload, ids) from None
        types = sorted({d.gpu_type for w in workers for d in self.inventories[w].devices if gpu_request.device_fits(d)})
        try:
            estimate = self.budget.estimate(request.gpus, request.est_seconds, types, request.est_tokens, request.model)
        except UnpriceableRequest as exc:
            raise self._deny("pricing", str(exc), f"add the price to BudgetBlock {self.budget_name!r}", payload, ids) from None
        payload["estimate"] = estimate.model_dump()
        flow_name, flow_version = flow
        facts = RunFacts(
            principal=self.config.principal, tenant=self.tenant, flow=flow_name, flow_version=flow_version,
            first_of_version=self._first_of_version(flow_name, flow_version),
            kind=request.kind, model=request.model, gpus=request.gpus,
            gpu_types=tuple(types),
            est_seconds=request.est_seconds, est_tokens=request.est_tokens, est_cost=estimate.amount,
        )
        chain, refusal = self._authorize(facts)
        if chain is None:
            fix = (f"delegate a grant that covers this run to {self.config.principal!r} (aisched grants delegate)"
                   if self.config.grant else
                   f"add or widen a grant for {self.config.principal!r} in AuthorityBlock {self.authority_name!r}")
            raise self._deny("authority", refusal, fix, payload, ids) from None
        grant_id = payload["grant"] = chain[-1].id
        priority = payload["priority"] = min([request.priority, *(g.max_priority for g in chain)])
        payload["chain"] = [g.id for g in chain]
        payload["grant_versions"] = {g.id: _version(g) for g in chain}
        outcome = self.policy.evaluate(facts) if self.policy else None
        payload["approval_rule"] = outcome.rule if outcome else None
        payload["policy_version"] = _version(self.policy) if self.policy else None
        if outcome is not None and outcome.action == "deny":
            raise self._deny("approval", f"approval policy rule {outcome.rule!r} denies this run",
                             "change the request or the rule in the ApprovalPolicyBlock", payload, ids)
        asking = outcome is not None and outcome.action == "ask"
        if asking:
            assert outcome is not None
            from prefect.utilities.hashing import hash_objects

            payload["approval_digest"] = approval_digest(
                run_key=run_key or ids["task_run_id"], task_name=payload["task"], parameters=hash_objects(*call),
                request=payload["request"], est_cost=estimate.amount, currency=self.budget.currency, rule=outcome.rule)
            payload["approvals_required"] = outcome.approvals_required
        usage = self._expected_usage(request, estimate.amount)
        shares = {g.id: g.budget_share for g in chain if g.budget_share < 1}
        lines = self._lines(facts, usage, shares)
        try:
            held, record = self.ledger.reserve(
                lines, kind="approval-requested" if asking else "admission",
                payload={**payload, "approval": "pending" if asking else "not required"}, **ids,
            )
        except BudgetExceeded as exc:
            raise self._deny("budget", str(exc), f"raise the limit of {exc.budget!r} in BudgetBlock {self.budget_name!r}, "
                             "or lower est_seconds/gpus/est_tokens", payload, ids) from None
        with self._running_lock:
            self._live_holds.update(h.id for h in held)
        if asking:
            assert outcome is not None
            record = self._ask_person(ApprovalRequest(
                flow_run_id=ids["flow_run_id"], task_run_id=ids["task_run_id"], task_name=payload["task"],
                principal=self.config.principal, grant_id=grant_id, chain=payload["chain"], request=payload["request"],
                est_cost=estimate.amount, currency=self.budget.currency,
                remaining_budget=min((h.remaining_after for h in held if h.unit == "money"), default=None), rule=outcome.rule,
                timeout_seconds=outcome.timeout_seconds, digest=payload["approval_digest"],
                approvals_required=outcome.approvals_required, require_signature=outcome.require_signature,
                call_index=self._completed_calls(ids["flow_run_id"], payload["approval_digest"]),
            ), held, payload, ids, facts)
        if facts.first_of_version:
            assert flow_name is not None and flow_version is not None
            self.ledger.mark_flow_version(flow_name, flow_version)
            self._versions_seen.add((flow_name, flow_version))
        return Admission(ticket=self._ticket(record.seq, request, ids, payload["chain"]), workers=workers, holds=held, reserved=estimate.amount,
                         priced_type=estimate.gpu_type_priced, chain=payload["chain"], facts=facts, shares=shares,
                         priority=priority,
                         expires_at=min((utc(g.expires_at).timestamp() for g in chain if g.expires_at), default=None))

    def _lines(self, facts: RunFacts, usage: Usage, shares: dict[str, float]) -> list[BudgetLine]:
        """Every account a run must fit: the block's covering limits, and for each grant of its chain
        with a budget_share below 1, that share of each of them, as an account of the grant's own
        (`<account>#<grant>`): all the grant's runs together, from any process, stay within it.
        """
        lines = self.budget.lines(self.budget_name, facts, usage)
        return lines + [line.model_copy(update={"budget": f"{line.budget}#{gid}", "limit": line.limit * share})
                        for gid, share in shares.items() for line in lines]

    def _first_of_version(self, flow: str | None, version: str | None) -> bool:
        """No run of this flow version was admitted yet; read only when a policy rule asks."""
        if self.policy is None or not self.policy.watches_flow_versions or flow is None or version is None:
            return False
        if (flow, version) in self._versions_seen:
            return False
        if self.ledger.flow_version_seen(flow, version):
            self._versions_seen.add((flow, version))
            return False
        return True

    def _approver_grant(self, approver: str, facts: RunFacts) -> list[Grant] | None:
        """The chain by which `approver` holds the right to approve a run like this one, if any."""
        roots, revoked = self._authority_now()
        stored = self.ledger.delegated_grants()
        for grant in [*roots.values(), *stored.values()]:
            if not (grant.can_approve and grant.covers_principal(approver)):
                continue
            try:
                chain = resolve_chain(grant.id, roots, stored, revoked)
            except ChainBroken:
                continue
            if grant.refusal(facts.model_copy(update={"principal": approver})) is None:
                return chain
        return None

    def _completed_calls(self, flow_run_id: str, digest: str) -> int:
        """Identical calls (same approval digest) of this flow run that already ran to completion.

        They are what tells this call apart from them, in this run and in the
        re-run after a suspension (where they come from persisted results and
        are not admitted again): each call's answer has its own pause key.
        """
        return sum(1 for r in self.ledger.records(flow_run_id)
                   if r.kind == "settlement" and r.payload.get("approval_digest") == digest
                   and r.payload.get("outcome") == "completed")

    def _record_batch(self, ask: ApprovalRequest) -> None:
        self.ledger.record("approval-batch", {"items": [i["task_run_id"] for i in ask.items], "digest": ask.digest,
                                              "est_cost": ask.est_cost, "task": ask.task_name},
                           flow_run_id=ask.flow_run_id, task_run_id=ask.task_run_id, principal=ask.principal)

    def _ask_person(self, ask: ApprovalRequest, held: list[Hold], payload: dict[str, Any],
                    ids: dict[str, Any], facts: RunFacts) -> EvidenceRecord:
        """Wait for the desk's decision (batched with concurrent asks); record it for this run.

        A rejection, silence or an abort voids this run's hold; an approval is
        followed by a fresh authority check (a revocation while the run waited
        denies it too). Returns the admission record.
        """
        verdict, items = self.desk.ask(ask, facts)
        leader = items[0].task_run_id == ask.task_run_id
        batch = ({"batch": [a.task_run_id for a in items], "batch_digest": verdict.ask.digest}
                 if len(items) > 1 and verdict.ask is not None else {})
        if isinstance(verdict.error, ApprovalSuspended):
            # The rule for long waits: a suspended run holds nothing. Its holds are released now (never
            # charged); the re-run after resume is admitted afresh (authority, budget) and finds its answer.
            self._settle(held, None, kind="approval-suspended", payload={
                **payload, "outcome": "suspended", **batch,
                "expires_at": time.time() + ask.timeout_seconds}, ids=ids)
            raise ApprovalSuspended(str(verdict.error))
        if verdict.error is not None:
            self._settle(held, None, kind="settlement", payload={**payload, "outcome": "approval-aborted", **batch}, ids=ids)
            if leader:
                raise verdict.error
            raise AdmissionDenied("approval", verdict.final.decision.reason, "run the flow again")
        if leader:  # answers before the final one, recorded once for the batch
            for vote, counted in verdict.votes:
                self.ledger.record("approval-vote", {**payload, **vote.decision.model_dump(exclude={"signature"}),
                                                     **vote.extra, **batch, "counted": counted}, **ids)
        final = {**payload, **verdict.final.decision.model_dump(exclude={"signature"}), **verdict.final.extra, **batch}
        if not verdict.approved:
            self._settle(held, None, kind="approval", payload={**final, "outcome": "rejected"}, ids=ids)
            decision = verdict.final.decision
            if decision.approver == "timeout":
                raise AdmissionDenied("approval", decision.reason, "answer sooner, or raise the rule's timeout_seconds")
            raise AdmissionDenied("approval", f"{decision.approver} rejected the run: {decision.reason}",
                                  "ask an approver again, or change the request")
        self.ledger.record("approval", {**final, "approved_by": list(verdict.approved_by),
                                        "approver_chains": {a: e.get("approver_chain") for a, e in verdict.approved_by.items()}},
                           **ids)
        chain, refusal = self._authorize(facts)
        if chain is None:
            self._settle(held, None, kind="settlement",
                         payload={**payload, "outcome": "revoked-while-waiting"}, ids=ids)
            raise self._deny("authority", refusal, "ask for a new grant", payload, ids)
        return self.ledger.record("admission", {**payload, "approval": ", ".join(verdict.approved_by),
                                                "holds": [h.model_dump() for h in held]}, **ids)

    # -- execution and settlement ---------------------------------------------------
    def _settle(self, held: list[Hold], charges: dict[str, float] | None, *, kind: str, payload: dict[str, Any],
                ids: dict[str, Any]) -> None:
        self.ledger.settle([h.id for h in held], charges, kind=kind, payload=payload, **ids)
        with self._running_lock:
            self._live_holds.difference_update(h.id for h in held)

    @staticmethod
    def _held(held: list[Hold]) -> dict[str, float]:
        """What the holds cover, per account: the charge of a run whose outcome is unknown."""
        out: dict[str, float] = {}
        for h in held:
            out[h.budget] = out.get(h.budget, 0.0) + h.reserved
        return out

    def _charges(self, facts: RunFacts, request: AIRequest, gpu_type: str | None, seconds: float,
                 reported: ReportedUsage | None, held: list[Hold], shares: dict[str, float]) -> dict[str, float]:
        """What a run used, per account it holds: GPU time at its real type, reported (else estimated) tokens.

        Accounts for GPU types it did not land on get nothing (their holds are voided).
        """
        tokens = reported.tokens if reported is not None else request.est_tokens
        money = self.budget.actual_cost(request.gpus, seconds, gpu_type)
        if reported is not None and reported.cost is not None:
            money += reported.cost
        elif tokens:
            try:
                money += tokens / 1000 * self.budget.token_price(request.model or "*")
            except UnpriceableRequest:  # reported tokens of a model the budget cannot price: charge the hold
                return self._held(held)
        used = Usage(money=money, gpu_hours=request.gpus * seconds / 3600, tokens=tokens)
        actual = facts.model_copy(update={"gpu_types": (gpu_type,)}) if gpu_type else facts
        return {line.budget: line.amount for line in self._lines(actual, used, shares)}

    def _wait_in_queue(self, state: _Running, request: AIRequest, admission: Admission, key: str) -> str | None:
        """Wait in the cluster's one queue (a scheduler plugin) for the worker this run may start on now."""
        state.queue_id = uuid.uuid4().hex  # known before the call, so a stop can take it out of the queue
        worker = self.client.sync(self.client.scheduler.gpu_queue_run, key=state.queue_id, tenant=self.tenant,
                                  gpus=int(request.gpus), estimate=request.est_seconds, priority=admission.priority,
                                  workers=admission.workers, client=self.client.id, preemptible=request.preemptible,
                                  task=key if request.preemptible else None)
        state.placed = worker is not None
        if worker is None:
            state.queue_id = None
        return None if state.stop_reason else worker

    def _leave_queue(self, state: _Running) -> None:
        """Give a run's GPUs back to the cluster's queue (once), learning whether the queue preempted it."""
        if state.queue_id is not None:
            state.preempted_for = self.client.sync(self.client.scheduler.gpu_queue_leave, id=state.queue_id)
            state.queue_id = None

    def _execute(self, fn: Callable[..., Any], request: AIRequest, args: tuple[Any, ...], kwargs: dict[str, Any],
                 admission: Admission, payload: dict[str, Any], ids: dict[str, Any], task_name: str) -> Any:
        """Run an admitted call; a run the cluster's queue preempts is charged for what ran and queued again."""
        requeued = 0
        while True:
            try:
                return self._execute_once(fn, request, args, kwargs, admission, payload, ids, task_name)
            except _Preempted:
                requeued += 1
                admission = self._requeue(request, admission, {**payload, "requeued": requeued}, ids)

    def _requeue(self, request: AIRequest, admission: Admission, payload: dict[str, Any], ids: dict[str, Any]) -> Admission:
        """Admit a preempted run again: authority and budget as they are now, a new hold and ticket.

        A grant revoked or a budget spent while it ran ends it here, denied. An
        approval it had covers the call and is not asked again.
        """
        chain, refusal = self._authorize(admission.facts)
        if chain is None:
            raise self._deny("authority", refusal, "ask for a new grant", payload, ids)
        usage = self._expected_usage(request, admission.reserved)
        try:
            held, record = self.ledger.reserve(self._lines(admission.facts, usage, admission.shares), kind="admission",
                                               payload={**payload, "approval": "requeued after preemption"}, **ids)
        except BudgetExceeded as exc:
            raise self._deny("budget", f"{exc} (queued again after a preemption)",
                             f"raise the limit of {exc.budget!r} in BudgetBlock {self.budget_name!r}", payload, ids) from None
        with self._running_lock:
            self._live_holds.update(h.id for h in held)
        return admission.model_copy(update={"ticket": self._ticket(record.seq, request, ids, admission.chain), "holds": held})

    @staticmethod
    def _expected_usage(request: AIRequest, money: float) -> Usage:
        """What a run is expected to use, as its holds are sized."""
        return Usage(money=money, gpu_hours=request.gpus * request.est_seconds / 3600, tokens=request.est_tokens)

    def _ticket(self, seq: int, request: AIRequest, ids: dict[str, Any], chain: list[str]) -> AdmissionTicket:
        """The signed ticket a worker checks before it runs this admission (record `seq`) of the call."""
        return self.signer.issue(admission_seq=seq, task_run_id=ids["task_run_id"], request_digest=request.digest,
                                 chain=tuple(chain), expires_at=time.time() + self.config.ticket_ttl_seconds)

    def _execute_once(self, fn: Callable[..., Any], request: AIRequest, args: tuple[Any, ...], kwargs: dict[str, Any],
                      admission: Admission, payload: dict[str, Any], ids: dict[str, Any], task_name: str) -> Any:
        submitted = time.monotonic()
        key = f"aisched-{task_name}-{ids['task_run_id']}-{uuid.uuid4().hex[:8]}"
        state = _Running(request=request, admission=admission, payload=payload, ids=ids,
                         holds=list(admission.holds), covered_seconds=request.est_seconds, submitted=submitted)
        with self._running_lock:
            self._running[key] = state
        workers = worker_restriction(request.gpu_request(), self.inventories, admission.workers)
        if self.config.queue and request.gpus >= 1:
            worker = self._wait_in_queue(state, request, admission, key)
            if worker is None:
                with self._running_lock:
                    self._running.pop(key, None)
                self._settle(state.holds, None, kind="settlement", payload={**payload, "outcome": "revoked-while-queued"}, ids=ids)
                raise AdmissionDenied("revocation", f"a grant in the chain {admission.chain} was revoked while the run "
                                      "waited in the cluster's queue", "ask for a new grant")
            workers = [worker]
        future: Future = self.client.submit(
            run_admitted, admission.ticket, request, fn, args, kwargs,
            key=key,
            resources=request.gpu_request().resources() or None,
            workers=workers,
            allow_other_workers=False, pure=False,
        )
        try:
            out: WorkerOutcome = future.result()
        except TicketRejected as exc:
            self._settle(state.holds, None, kind="settlement", payload={**payload, "outcome": "ticket-rejected", "error": str(exc)}, ids=ids)
            raise
        except StopRequested:  # stopped before it started: preempted (queued again) or revoked
            self._leave_queue(state)
            if state.preempted_for is not None and state.stop_reason is None:
                self._settle(state.holds, None, kind="settlement", payload={
                    **payload, "outcome": "preempted-before-start", "preempted_for": state.preempted_for}, ids=ids)
                raise _Preempted() from None
            self._settle(state.holds, None, kind="settlement", payload={**payload, "outcome": "revoked-while-queued"}, ids=ids)
            raise AdmissionDenied("revocation", f"a grant in the chain {admission.chain} was revoked before the task started",
                                  "ask for a new grant") from None
        except KilledWorker as exc:  # the worker died mid-task: charge what can have run, at most the hold
            ran = time.monotonic() - submitted
            held = self._held(state.holds)
            ran_cost = self._charges(admission.facts, request, admission.priced_type, ran, None, state.holds, admission.shares)
            self._settle(state.holds, {b: min(v, held.get(b, 0.0)) for b, v in ran_cost.items()}, kind="settlement", payload={
                **payload, "outcome": "worker-died", "error": f"{type(exc).__name__}: {exc}", "seconds": ran}, ids=ids)
            raise
        except BaseException as exc:  # cancelled, interrupted: outcome unknown, charge the hold
            self._settle(state.holds, self._held(state.holds), kind="settlement",
                         payload={**payload, "outcome": "lost", "error": f"{type(exc).__name__}: {exc}"}, ids=ids)
            raise
        finally:
            future.release()
            with self._running_lock:
                self._running.pop(key, None)
            self._leave_queue(state)  # its GPUs go back to the cluster's queue
        run = out.run
        stopped = None
        if not out.ok and isinstance(out.error, StopRequested):
            stopped = state.stop_reason or ("preempted" if state.preempted_for is not None else None)
        if out.logs:
            from prefect.logging import get_run_logger

            task_log = get_run_logger()
            for level, message in out.logs:
                task_log.log(level, message)
        charges = self._charges(admission.facts, request, run.gpu_type, run.seconds, out.usage, state.holds, admission.shares)
        outcome = "completed" if out.ok else f"stopped-{stopped}" if stopped else "failed"
        self._settle(state.holds, charges, kind="settlement", payload={
            **payload, "outcome": outcome,
            "error": None if out.ok else f"{type(out.error).__name__}: {out.error}",
            "placement": {"worker": run.worker, "host": run.host, "devices": run.device_keys,
                          "gpu_type": run.gpu_type, "source": run.source,
                          "live": None if run.live is None else {k: v.model_dump() for k, v in run.live.items()}},
            "seconds": run.seconds, "gpu_seconds": run.seconds * len(run.devices),
            "covered_seconds": state.covered_seconds, "top_ups": len(state.holds) - len(admission.holds),
            "usage": out.usage.model_dump() if out.usage else None, "charges": charges,
            **({"preempted_for": state.preempted_for} if stopped == "preempted" else {}),
        }, ids=ids)
        if stopped == "preempted":
            logger.warning("AI task %s was preempted after %.1fs to give tenant %r its quota back; charged for that "
                           "and queued again", task_name, run.seconds, state.preempted_for)
            raise _Preempted()
        if stopped == "budget":
            raise AdmissionDenied("budget", f"the task ran {run.seconds:.1f}s, all its budget holds cover "
                                  f"({state.covered_seconds:.1f}s), and a top-up was refused ({state.top_up_refused}); "
                                  "it was stopped and charged for what ran",
                                  "raise est_seconds, or the budget limit, or the grant's max cost")
        if stopped:
            raise AdmissionDenied("revocation", f"a grant in the chain {admission.chain} was revoked while the task ran; "
                                  f"it was stopped after {run.seconds:.1f}s and charged for that", "ask for a new grant")
        if not out.ok:
            assert out.error is not None
            logger.error("AI task %s failed on %s devices %s:\n%s", task_name, run.worker, run.device_keys, out.error_text)
            raise out.error
        return out.value

    # -- evidence artifact ----------------------------------------------------------
    def _publish_artifacts(self) -> None:
        if not getattr(self, "flow_run_ids", None):
            return
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import ArtifactCreate

        with get_client(sync_client=True) as client:
            for flow_run_id in sorted(self.flow_run_ids):
                rows = evidence_rows(self.ledger.records(flow_run_id))
                client.create_artifact(ArtifactCreate(
                    key=ARTIFACT_KEY, type="table", data=rows, flow_run_id=UUID(flow_run_id),
                    description="AI task runs admitted, denied and settled by aisched-prefect in this flow run.",
                ))
                try:  # usage and cost: this flow run's, and today's (overwritten by each run)
                    from aisched_prefect.usage_report import publish_report_artifacts

                    publish_report_artifacts(self.ledger, flow_run_id, client=client)
                except Exception:  # a report that cannot be published never fails the flow
                    logger.exception("could not publish the usage report artifacts of flow run %s", flow_run_id)
