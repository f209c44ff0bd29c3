"""A run whose worker or scheduler went away under it: found, recorded once, charged for at most what it had."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import cloudpickle
from distributed import Client

from aisched_prefect.control.dispatch.handover import PlaneStopping
from aisched_prefect.control.dispatch.running import Lost, Running, base_payload, held_by_account
from aisched_prefect.wire import Reply
from dask_gpu import WorkerDied
from dask_gpu.slurm.jobs import slurm_end
from dask_gpu.tickets import LEFT_OP, STATES_OP, WHERE_OP

logger = logging.getLogger("aisched_prefect.control")
# A run handed to Dask whose key the scheduler still does not know after this long is lost (its worker took it
# along unseen). Not sooner: a scheduler busy with a burst (a .map() of 10,000) may take seconds to see a submit.
VANISHED_SECONDS = 30.0


class Losses:
    """The dispatcher's part that notices lost workers and a lost scheduler (a mixin of Dispatcher)."""

    def _on_worker_died(self, event: tuple[float, dict[str, Any]]) -> None:
        """The ticket registry's event: a worker left, and these runs were on it (runs in the client's loop)."""
        msg = event[1]
        if msg.get("worker"):  # sent for every worker that leaves: its idle warm bodies' time counts to now
            threading.Thread(target=self.warm.worker_died, args=(msg["worker"], time.time()), daemon=True).start()
        devices = {r["key"]: r.get("devices", []) for r in msg.get("runs", [])}
        slurm = {r["key"]: r["slurm_job"] for r in msg.get("runs", []) if r.get("slurm_job")}
        keys = set(msg.get("keys", [])) | set(devices)
        with self.lock:
            for r in self.running.values():
                hit = [k for k in r.dask_keys if k in keys]
                if not hit and _handed_to(r, msg.get("worker")):  # no Dask task to be named by: where it was sent
                    hit = list(r.dask_keys)
                    devices.setdefault(hit[0], _placed_devices(r))
                if hit and r.lost is None:
                    r.lost = {"worker": msg.get("worker"), "name": msg.get("name"), "keys": hit,
                              "devices": [d for k in hit for d in devices.get(k, [])], "expected": msg.get("expected"),
                              **({"slurm_job": slurm[hit[0]]} if hit[0] in slurm else {})}
                    r.wake.set()

    def check_stuck(self, running: dict[str, Running]) -> None:
        """The backstop of `_on_worker_died` (the watcher calls it): a run whose task waits in `no-worker` (pinned
        to a worker that died) or vanished from the scheduler is ended as lost, whatever events it missed."""
        self._check_handed_over(running)
        keys = {k: r for r in running.values() if r.dask_at is not None and r.lost is None and not r.handed_over
                for k in r.dask_keys}  # a handed-over run has no Dask task: its worker's leave is checked above
        if not keys:
            return
        try:
            states = self.client.sync(getattr(self.client.scheduler, STATES_OP), keys=list(keys))
        except Exception:  # a scheduler without the registry: nothing to check against
            return
        for key, st in states.items():
            r = keys[key]
            vanished = st is None and time.monotonic() - (r.dask_at or 0) > VANISHED_SECONDS
            if vanished or (st and st["state"] == "no-worker"):
                where = self._where(r)
                member = next((m for m in where.get("members", []) if m.get("key") == key), {})
                r.lost = {"worker": member.get("worker"), "name": member.get("name"), "keys": [key],
                          "devices": member.get("devices", []), "found": st["state"] if st else "gone",
                          **({"slurm_job": member["slurm_job"]} if member.get("slurm_job") else {})}
                r.wake.set()

    def _check_handed_over(self, running: dict[str, Running]) -> None:
        """A handed-over run whose worker left the cluster is lost, even where its connection still stands (a
        stopped or deadlocked worker process: its host still answers TCP)."""
        handed = [r for r in running.values() if r.handed_over and r.lost is None and r.placement is not None]
        if not handed:
            return
        try:
            left = self.client.sync(getattr(self.client.scheduler, LEFT_OP))
        except Exception:  # a scheduler without the registry: its connection's end is all there is
            return
        for r in handed:
            assert r.placement is not None
            worker = r.placement.workers[0]
            gone = left.get(worker)  # after its ticket was issued: not an earlier worker there
            if gone is not None and r.ticket is not None and gone >= r.ticket.issued_at:
                # Its name as the registry has it (the death event's word may come after this, and the first word
                # is the one recorded): the evidence names a worker, not an address a restarted one takes over.
                member = next((m for m in self._where(r).get("members", []) if m.get("worker") == worker), {})
                r.lost = {"worker": worker, "name": member.get("name"), "keys": list(r.dask_keys),
                          "devices": _placed_devices(r), "found": "left"}
                r.wake.set()

    def _where(self, state: Running) -> dict[str, Any]:
        if state.ticket is None:
            return {}
        try:
            return self.client.sync(getattr(self.client.scheduler, WHERE_OP), id=state.ticket.id) or {}
        except Exception:
            return {}

    def _lost_from(self, state: Running, exc: BaseException) -> dict[str, Any]:
        """What died under a run whose task failed with KilledWorker, or whose re-run the ticket refused."""
        where = self._where(state)
        worker = getattr(getattr(exc, "last_worker", None), "address", None)
        if state.lost is not None:
            return state.lost
        members = where.get("members", [])
        lost = next((m for m in members if m.get("worker") == worker), None) or (members[0] if members else {})
        return {"worker": worker or lost.get("worker"), "name": lost.get("name") or getattr(
            getattr(exc, "last_worker", None), "name", None), "devices": lost.get("devices", []),
            "keys": [lost.get("key")] if lost.get("key") else [],
            **({"slurm_job": lost["slurm_job"]} if lost.get("slurm_job") else {})}

    def _worker_died(self, state: Running, exc: Lost) -> tuple[Reply, bytes]:
        """The worker died mid-task: record it (the worker, the devices lost), charge what can have run (at most the
        hold), and list every attempt: the one that died and any re-run the ticket registry refused."""
        adm, lost = state.admission, exc.lost
        ran, charges = self._charged_for_time(state)
        where = self._where(state)
        attempts = [{"attempt": 1, "outcome": "worker-died", "worker": lost.get("worker"), "name": lost.get("name"),
                     "devices": lost.get("devices", []), "seconds": ran, "members": where.get("members", [])}]
        attempts += [{"attempt": i, "outcome": "refused: its ticket was already used (Dask re-ran it by itself)",
                      "worker": r.get("worker"), "name": r.get("name"), "member": r.get("member"), "seconds": 0.0}
                     for i, r in enumerate(where.get("refused", []), start=2)]
        slurm = slurm_end(lost.get("slurm_job"))  # the Slurm job it ran in: how Slurm says it ended
        self.ledger.record("worker-died", {**base_payload(adm), "worker": lost.get("worker"), "name": lost.get("name"),
                                           "devices": lost.get("devices", []), "keys": lost.get("keys", []),
                                           "seconds": ran, **({"slurm": slurm.model_dump()} if slurm else {})},
                           **adm.ids)
        who = lost.get("name") or lost.get("worker") or "?"
        lost_devices = ",".join(lost.get("devices") or []) or "?"
        in_slurm = f" ({slurm.describe()})" if slurm else ""
        self.settle(state, charges, {"outcome": "worker-died", "error": f"worker {who} died while it ran the task{in_slurm}",
                                     "seconds": ran, "attempts": attempts, "charges": charges,
                                     "placement": {"worker": lost.get("worker"), "name": lost.get("name"),
                                                   "devices": lost.get("devices", []),
                                                   **({"slurm_job": slurm.job} if slurm else {})},
                                     **({"slurm": slurm.model_dump()} if slurm else {})})
        logger.warning("AI task %s: worker %s died under it after %.1fs (devices %s); charged for that",
                       adm.task_name, who, ran, lost_devices)
        message = (f"the worker {who} running this task died{in_slurm} (devices {lost_devices} lost); it was charged "
                   f"for at most {ran:.1f}s")
        return Reply(status="failed", admission=adm.id, error_type="dask_gpu.errors.WorkerDied",
                     error_message=message), cloudpickle.dumps(WorkerDied(message))

    def _charged_for_time(self, state: Running) -> tuple[float, dict[str, float]]:
        """A run whose outcome is unknown (its worker or the scheduler went away): how long it can have run since
        its hand-over, and that time's charge per account, at most what each holds."""
        adm = state.admission
        started = state.dask_at if state.dask_at is not None else state.submitted
        ran = time.monotonic() - started
        held = held_by_account(state.holds)
        cost = self.charges(adm, adm.priced_type, ran, None, state.holds)
        return ran, {b: min(v, held.get(b, 0.0)) for b, v in cost.items()}

    def _scheduler_lost(self, state: Running, exc: BaseException) -> tuple[Reply, bytes]:
        """The Dask scheduler went away under a handed-over run: its outcome is unknown (its worker may even have
        finished it), so it is charged for the time it had, at most its hold, and its caller gets SchedulerLost,
        which Prefect retries where `retries=` says."""
        from aisched_prefect.errors import SchedulerLost

        adm = state.admission
        ran, charges = self._charged_for_time(state)
        address = getattr(getattr(self.client, "scheduler", None), "address", None) or "the Dask scheduler"
        message = (f"the Dask scheduler ({address}) was lost while this run was on the cluster "
                   f"({type(exc).__name__}); it was charged for at most {ran:.1f}s. Fix: retry it (retries=), and "
                   "run the scheduler under a supervisor that restarts it")
        if isinstance(exc, PlaneStopping):
            message = f"{exc}; it was charged for at most {ran:.1f}s. Fix: retry it (retries=) once the plane is back"
        outcome = "plane-stopped" if isinstance(exc, PlaneStopping) else "scheduler-lost"
        self.settle(state, charges, {"outcome": outcome, "error": message, "seconds": ran, "charges": charges})
        logger.warning("AI task %s: %s", adm.task_name, message)
        return Reply(status="failed", admission=adm.id, error_type="aisched_prefect.errors.SchedulerLost",
                     error_message=message), cloudpickle.dumps(SchedulerLost(message))


def _scheduler_gone(exc: BaseException, client: Client) -> bool:
    """Whether `exc` is Dask cancelling a run because the client lost its scheduler (not a stop of ours), or the
    plane stopping under a run it handed over."""
    return isinstance(exc, PlaneStopping) or "scheduler-connection-lost" in f"{exc!r} {exc}" or (
        type(exc).__name__ in ("CancelledError", "FutureCancelledError") and client.status != "running")


def _handed_to(r: Running, worker: str | None) -> bool:
    """Whether `worker` is the one run `r` was handed to (a handed-over run has no Dask task to be named by)."""
    return bool(r.handed_over and worker and r.placement is not None and r.placement.workers[0] == worker)


def _placed_devices(r: Running) -> list[str]:
    """The devices the queue placed run `r` on (its worker's, for a run that is not a gang)."""
    return list(r.placement.devices[0]) if r.placement is not None and r.placement.devices else []
