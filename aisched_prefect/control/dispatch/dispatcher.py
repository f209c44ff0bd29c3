"""Dispatch on the control plane: hand an admitted run to Dask with its ticket, wait, settle exactly once.

The control plane is the only Dask client. A run goes to Dask when it can
start (through the cluster's queue, on by default: the queue answers which
workers and devices), as `run_ticketed(ticket, body)`: the worker checks the
ticket and runs the body in its own process. A multi-host run (a gang) is one
admission and one ticket, and one Dask task per member on its whole worker;
one member failing stops the others. However the run ends (completed, failed,
stopped, its worker dead, the caller gone) its holds are settled once, with
what it really used; a worker's death is recorded (`worker-died`: the worker
and the devices lost) and the settlement lists each attempt, also one Dask
re-ran by itself, which the ticket registry refused.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import Any

from distributed import Client, Future, KilledWorker

from aisched_prefect.control.admission.record import Admission, Readmitter
from aisched_prefect.control.admission.capacity import CapacityWaits
from aisched_prefect.control.dispatch.handover import HandedOver, Handovers, WorkerUnreachable
from aisched_prefect.control.dispatch.losses import Losses, _scheduler_gone
from aisched_prefect.control.dispatch.model_slots import ModelSlots
from aisched_prefect.control.dispatch.queueing import Queueing
from aisched_prefect.control.dispatch.running import (
    Lost, ModelSlotUnavailable, Placement, Preempted, Running, denied, held_by_account)
from aisched_prefect.control.dispatch.settlement import Settlement
from aisched_prefect.control.authority.state import AuthorityState
from aisched_prefect.control.dispatch.time_limit import TimeLimitRequeue
from aisched_prefect.errors import AdmissionDenied
from aisched_prefect.control.dispatch.warm import WarmBooks, warm_key
from aisched_prefect.control.dispatch.warm_tail import Arrivals, WarmTail
from aisched_prefect.ledger import Ledger
from aisched_prefect.settings import Settings
from aisched_prefect.wire import Reply
from dask_gpu import WorkerInventory, cluster_inventories, end_warm, request_stop
from dask_gpu.worker.bodies import WARM_TOPIC
from dask_gpu.errors import StopRequested
from dask_gpu.scheduler.queue import PLACED_STREAM_OP
from dask_gpu.worker.records import Body, Outcome
from dask_gpu.worker.sandbox import run_ticketed
from dask_gpu.tickets import DIED_TOPIC, Ticket, TicketRejected, TicketSigner

logger = logging.getLogger("aisched_prefect.control")
# A handed-over run's connection broke: how long the scheduler's word (the worker left, or the scheduler is gone
# too) is awaited before the worker is taken for lost on the connection's word alone.
UNREACHABLE_GRACE_SECONDS = 2.0


class Dispatcher(Queueing, Settlement, Losses, ModelSlots, CapacityWaits):
    """Everything that touches Dask, and the table of running work the watcher keeps honest."""

    def __init__(self, client: Client, signer: TicketSigner, ledger: Ledger, state: AuthorityState, settings: Settings,
                 queue: bool = True) -> None:
        self.client, self.signer, self.ledger, self.state, self.settings = client, signer, ledger, state, settings
        self.queue = queue
        self.running: dict[str, Running] = {}
        self.ran_before: dict[str, float] = {}  # admission id -> what its call ran before a requeue at its time limit
        self.lock = threading.Lock()
        self._inventories: dict[str, WorkerInventory] = {}
        self._inventories_at = 0.0
        self._inv_lock = threading.Lock()
        self._gang_lock = threading.Lock()  # queue off: one gang at a time looks for whole idle workers
        self.handovers = Handovers(client)  # runs the queue placed, sent straight to their workers
        client.subscribe_topic(DIED_TOPIC, self._on_worker_died)  # the ticket registry names what a dead worker took
        self.warm = WarmBooks(ledger, self._bound, lambda bodies, why: end_warm(client, bodies, why),
                              patience=self.settle_patience())
        self.warm.load()  # the idle bodies booked before this plane started (its earlier life, another replica)
        client.subscribe_topic(WARM_TOPIC, self.warm.on_event)  # a worker ended a warm body: settle its idle time
        self.warm_tail = WarmTail(self.warm, self._waiting_by_key, lambda: self.settings.warm_linger_seconds)
        self.arrivals = Arrivals()  # a map's shards its flow has not sent yet: its bodies still have work
        # Runs waiting in the cluster's queue: answered on the client's stream (no thread, no connection each).
        self._entered: dict[str, tuple[Running, Callable[[Placement | None], None]]] = {}
        self._calls: set[str] = set()  # call keys this replica follows, queued or running
        client._stream_handlers[PLACED_STREAM_OP] = self._on_placed

    def _waiting_by_key(self) -> dict[tuple[str, str], tuple[int, int]]:
        """Runs by (warm key, flow run): (not placed yet or not sent yet by its map's flow, placed and not ended):
        what an idle body of that key may still serve, and whether its flow run's work of that key goes on
        (control.dispatch.warm_tail)."""
        out: dict[tuple[str, str], tuple[int, int]] = {k: (n, 0) for k, n in self.arrivals.to_come().items()}
        with self.lock:
            states = list(self.running.values())
        for r in states:
            if r.stop_reason is not None or r.settled:
                continue
            k = (warm_key(r.admission), r.admission.flow_run_id)
            waiting, busy = out.get(k, (0, 0))
            out[k] = (waiting + 1, busy) if not r.placed and r.started_at is None else (waiting, busy + 1)
        return out

    def inventories(self, fresh: bool = False) -> dict[str, WorkerInventory]:
        """The workers' inventories (at most inventory_ttl_seconds old). With the scheduler gone, feasibility
        cannot be decided: AdmissionDenied naming it (recorded as a denial), at once, never a bare error later."""
        with self._inv_lock:
            if fresh or time.monotonic() - self._inventories_at > self.settings.inventory_ttl_seconds or not self._inventories:
                if self.client.status != "running":
                    raise scheduler_unreachable(self.client, "it is being reconnected")
                try:
                    self._inventories = self.with_capacity(cluster_inventories(self.client))  # and the scaler's groups
                except (OSError, TimeoutError) as exc:
                    raise scheduler_unreachable(self.client, f"{type(exc).__name__}: {exc}") from None
                self._inventories_at = time.monotonic()
            return self._inventories

    def execute(self, admission: Admission, body: Body, admitter: Readmitter) -> tuple[Reply, bytes]:
        """Run an admitted call; a run the cluster's queue preempts is charged for what ran and queued again."""
        requeued, ran = 0, 0.0
        try:
            while True:
                try:
                    return self._execute_once(admission, body, admitter)
                except Preempted as exc:
                    requeued += 1
                    why = "preempted"
                    if isinstance(exc, TimeLimitRequeue):  # stopped at its limit: it resumes from its own checkpoint
                        why, ran = "time-limit", ran + exc.seconds
                    self.ran_before.pop(admission.id, None)
                    admission = admitter.readmit(admission, f"{why} ({requeued})")
                    if ran:
                        self.ran_before[admission.id] = ran  # the queue learns its whole run so far
        finally:
            self.ran_before.pop(admission.id, None)

    def _ticket(self, admission: Admission, attempt_key: str, shares: list[int] | None = None,
                workers: list[str] | None = None) -> Ticket:
        request = admission.request.gpu_request()
        if shares:  # a gang: the ticket names how many members there are and what each holds
            request = request.model_copy(update={"hosts": len(shares)})
        warm = warm_key(admission) if not shares else ""
        return self.signer.issue(run=f"{admission.id}/{attempt_key}", payload_digest=admission.payload_digest,
                                 code_digest=admission.code_digest, request=request,
                                 ttl_seconds=self.settings.ticket_ttl_seconds,
                                 lease_seconds=self.settings.body_lease_seconds,
                                 hosts=len(shares) if shares else 1, shares=shares or (), tenant=admission.tenant,
                                 workers=tuple(workers or ()), warm=warm,
                                 keep_warm=self.keep_warm(admission) if warm else 0.0)

    def _execute_once(self, admission: Admission, body: Body, admitter: Readmitter) -> tuple[Reply, bytes]:
        request = admission.request
        state = self._register(admission)
        key = state.key
        workers = admission.workers
        gpu_request = request.gpu_request()
        try:
            with self._model_slot(state):  # registered first: its holds are renewed while it waits for a slot
                if state.stop_reason is not None:  # its authority ended while it waited: it never ran
                    self.settle(state, None, {"outcome": "revoked-while-waiting", "stopped": state.stop_reason})
                    return denied("revocation", f"a grant in the chain {admission.chain} was revoked while the "
                                  f"call waited for its model's limit ({state.stop_reason})", "ask for a new grant"), b""
                return self._submit(state, body, workers, gpu_request, admitter=admitter)
        except ModelSlotUnavailable as exc:  # it never ran: void its holds
            self.settle(state, None, {"outcome": "model-limit-unavailable", "error": str(exc)})
            return denied("model-limit", f"the call could not get a slot under its model's limit ({exc})",
                          "check that the cluster's scheduler carries the model limits (dask-gpu-scheduler preloads "
                          "them; `aisched serve` installs them)"), b""
        finally:
            with self.lock:
                self.running.pop(key, None)

    def _is_gang(self, admission: Admission) -> bool:
        """A multi-host run: only one that asked for several hosts (feasibility refused one wider than every worker
        without `hosts`)."""
        return admission.request.gpu_request().gang()

    def _submit(self, state: Running, body: Body, workers: list[str] | None, gpu_request: Any,
                placement: Placement | None | str = "wait", admitter: Readmitter | None = None) -> tuple[Reply, bytes]:
        """Hand the run to Dask and follow it; `placement`: where the queue already started it (None: it left the
        queue), or "wait" to wait in the queue here. A map's shard admitted to hold at its start holds now."""
        admission, key = state.admission, state.key
        request = admission.request
        gang = request.gpus >= 1 and self._is_gang(admission)
        try:
            if self.queue and request.gpus > 0 and placement != "wait":  # the queue answered on the stream
                state.placement = placement if isinstance(placement, Placement) else None
            elif self.queue and request.gpus > 0:  # every GPU run waits in the cluster's one queue
                state.placement = self._wait_in_queue(state)
            elif gang:  # the queue is off: whole workers that are idle now
                state.placement = self._place_gang(state)
            if (self.queue and request.gpus > 0) or gang:
                if state.placement is None and state.stop_reason == "abandoned":
                    self.settle(state, None, {"outcome": "abandoned-while-queued"})
                    return Reply(status="stopped", reason="its flow process went away while it waited in the queue",
                                 error_type="dask_gpu.errors.StopRequested",
                                 error_message="stopped: its flow process went away"), b""
                if (no_capacity := self.capacity_denied(state)) is not None:  # its group started nothing in time
                    self.settle(state, None, {"outcome": "no-capacity", "error": no_capacity[0]})
                    return denied("capacity", *no_capacity), b""
                if state.placement is None:
                    self.settle(state, None, {"outcome": "revoked-while-queued"})
                    return denied("revocation", f"a grant in the chain {admission.chain} was revoked while the run "
                                  "waited in the cluster's queue", "ask for a new grant"), b""
            if admission.hold_at_start and (refused := self._hold_at_start(state, admitter)) is not None:
                return refused, b""  # its place in the queue is given back below
            futures = self._hand_over(state, body, workers, gpu_request, gang)
            try:
                results = self._await(state, futures)
            finally:
                for f in futures:
                    f.release()
            if state.handed_over and not request.preemptible and isinstance(results[0], Outcome):
                # Its worker freed its place (step 8) on its own stream to the scheduler, with the warm body parked
                # there: a leave sent from here could pass that message and free the devices under the body.
                state.queue_id = None
        except Lost as exc:
            return self._worker_died(state, exc)
        except BaseException as exc:  # cancelled, interrupted: outcome unknown, charge the hold
            if _scheduler_gone(exc, self.client):
                return self._scheduler_lost(state, exc)
            self.settle(state, held_by_account(state.holds), {"outcome": "lost", "error": f"{type(exc).__name__}: {exc}"})
            raise
        finally:
            with self.lock:
                self.running.pop(key, None)
            self._leave_queue(state)
        died = [r for r in results if isinstance(r, (KilledWorker, TicketRejected)) and
                (not isinstance(r, TicketRejected) or "already used" in str(r))]
        if died:  # the worker died (allowed-failures 0), or Dask re-ran the task and the ticket refused it
            return self._worker_died(state, Lost(self._lost_from(state, died[0])))
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None and _scheduler_gone(failed, self.client):
            return self._scheduler_lost(state, failed)
        if isinstance(failed, TicketRejected):
            self.settle(state, None, {"outcome": "ticket-rejected", "error": str(failed)})
            return denied("ticket", str(failed), "the worker and the control plane disagree: see the worker's log"), b""
        if isinstance(failed, StopRequested) and state.preempted_for is not None:
            # The queue preempted it between its placement and its start (the worker's stop came first): it ran
            # nothing, so its holds are voided, and it is admitted and queued again.
            self.settle(state, None, {"outcome": "stopped-preempted", "stopped": "preempted before it started",
                                      "seconds": 0.0, "preempted_for": state.preempted_for})
            logger.warning("AI task %s was preempted before it started, for tenant %r; queued again",
                           admission.task_name, state.preempted_for)
            raise Preempted()
        if failed is not None:
            self.settle(state, held_by_account(state.holds), {"outcome": "lost", "error": f"{type(failed).__name__}: {failed}"})
            raise failed
        if len(results) > 1:
            return self._finish(state, *_combine(results))  # type: ignore[arg-type]
        return self._finish(state, results[0])  # type: ignore[arg-type]

    def _hand_over(self, state: Running, body: Body, workers: list[str] | None, gpu_request: Any,
                   gang: bool) -> list[Future]:
        """Submit the run to Dask with its ticket: one task, or one per gang member on its worker."""
        place = state.placement
        if not gang:
            devices = list(place.devices[0]) if place is not None and place.devices else None  # a list, as Body says
            state.ticket = self._ticket(state.admission, state.key,
                                        workers=place.workers if place is not None else workers)
            state.dask_at = time.monotonic()
            # Its worker frees its place in the queue as its body ends; a preemptible run's leave must say whether
            # the queue stopped it, so the control plane keeps that one.
            freed = state.queue_id if place is not None and not state.admission.request.preemptible else None
            warm_body = place.body if place is not None else None
            body = body.model_copy(update={"devices": devices, "queue_key": freed, "warm_body": warm_body})
            if place is not None and self.settings.hand_over_placed:  # the queue chose its worker: no Dask task
                state.handed_over = True
                return [self.handovers.send(place.workers[0], state.ticket, body, state.key)]
            return [self.client.submit(
                run_ticketed, state.ticket, body, key=state.key,
                resources=gpu_request.resources() or None, workers=place.workers if place is not None else workers,
                allow_other_workers=False, pure=False)]
        assert place is not None
        shares = [int(x) for x in place.shares]
        state.ticket = ticket = self._ticket(state.admission, state.key, shares, workers=place.workers)
        state.members = [f"{state.key}-m{i}" for i in range(len(place.workers))]
        state.dask_at = time.monotonic()
        return [self.client.submit(
            run_ticketed, ticket, body.model_copy(update={"member": i, "devices": list(place.devices[i]) if place.devices else None}),
            key=state.members[i], resources=gpu_request.member(shares[i]).resources() or None, workers=[worker],
            allow_other_workers=False, pure=False) for i, worker in enumerate(place.workers)]

    def _await(self, state: Running, futures: list[Future]) -> list[Outcome | BaseException]:
        """Wait for every task of the run; a member that fails stops the others; a dead worker ends the wait.

        No polling: a future's end and the ticket registry's `aisched-worker-died` event both wake it.
        """
        for f in futures:
            f.add_done_callback(lambda _: state.wake.set())
        results: dict[int, Outcome | BaseException] = {}
        stopping = False
        while True:
            for i, f in enumerate(futures):
                if i not in results and f.done():
                    results[i] = _result(f)  # fetched once (a finished task's result is still on its worker)
            if len(results) == len(futures):
                if isinstance(results[0], WorkerUnreachable) and not self._worker_left(state):
                    results[0] = CancelledError(f"scheduler-connection-lost: {results[0]}")  # as a Dask task's
                break
            if state.lost is not None:  # its worker is gone: whatever Dask does next, this attempt is over
                self._stop_following(state, futures)
                raise Lost(state.lost)
            if len(futures) > 1 and not stopping and any(_failed(r) for r in results.values()):
                stopping = True  # one member failed: the gang cannot go on
                request_stop(self.client, [k for i, k in enumerate(state.dask_keys) if i not in results])
            state.wake.wait(5.0)
            state.wake.clear()
        return [results[i] for i in range(len(futures))]

    def _stop_following(self, state: Running, futures: list[Any]) -> None:
        """Its worker is lost: stop following its tasks, and stop its body wherever it may still run (a gang's other
        members; a handed-over run whose connection broke while its worker lives on)."""
        handed = [f for f in futures if isinstance(f, HandedOver)]
        for f in handed:
            f.cancel()
        self.client.cancel([f for f in futures if not isinstance(f, HandedOver) and not f.done()], force=True)
        if len(futures) > 1 or handed:
            request_stop(self.client, state.dask_keys)

    def _worker_left(self, state: Running) -> bool:
        """A handed-over run's connection broke: whether its scheduler still stands (then the run's worker is lost,
        and its body, if it lives on, is asked to stop), or went too (a scheduler outage: its workers go with it).
        The scheduler's end reaches the client as its stream closes, at most a moment after the worker's."""
        deadline = time.monotonic() + UNREACHABLE_GRACE_SECONDS
        while state.lost is None and self.client.status == "running" and time.monotonic() < deadline:
            state.wake.wait(0.05)
            state.wake.clear()
        if self.client.status != "running":
            return False
        try:
            request_stop(self.client, state.dask_keys)
        except Exception as exc:  # noqa: BLE001 - the body's lease, which only this plane renews, still ends it
            logger.warning("could not ask the workers to stop %s: %s", state.key, exc)
        return True

    def resubscribe(self) -> None:
        """After a reconnect: the worker-death events and the queue's answers again (a new scheduler knows neither),
        and the warm books against what the workers say (ends that happened while it was away)."""
        self.client.subscribe_topic(DIED_TOPIC, self._on_worker_died)
        self.client.subscribe_topic(WARM_TOPIC, self.warm.on_event)
        self.client._stream_handlers[PLACED_STREAM_OP] = self._on_placed
        threading.Thread(target=self.reconcile_warm, name="aisched-warm-reconcile", daemon=True).start()

    def reconcile_warm(self) -> dict[str, int]:
        """The warm books against the workers' reports (control.warm_reconcile); logged, never raised."""
        from aisched_prefect.control.dispatch.warm_reconcile import reconcile, worker_reports

        try:
            return reconcile(self.warm, lambda: worker_reports(self.client),
                             lambda bodies, why: end_warm(self.client, bodies, why))
        except Exception:
            logger.exception("could not reconcile the warm bodies with the workers; trying again later")
            return {}


def scheduler_unreachable(client: Client, why: str) -> AdmissionDenied:
    address = getattr(getattr(client, "scheduler", None), "address", None) or "?"
    return AdmissionDenied("feasibility", f"the Dask scheduler at {address} does not answer ({why}): which workers "
                           "could run this call cannot be known", "retry once the control plane's /v1/health is "
                           "green (it reconnects by itself); a task with retries= runs again")


def _result(f: Future) -> Outcome | BaseException:
    """A finished future's outcome, or what it raised (a member's end is judged by the caller)."""
    try:
        return f.result()
    except BaseException as exc:  # noqa: BLE001
        return exc


def _failed(result: Outcome | BaseException) -> bool:
    """A member that ended without completing: an error, or a body that failed."""
    return isinstance(result, BaseException) or not result.ok


def _combine(results: list[Any]) -> tuple[Outcome, list[dict[str, Any]]]:
    """A gang's members as one outcome: ok when all are, member 0's value, the first real failure's error (a member
    stopped because another failed is not that failure), the longest member's seconds, every member's devices."""
    outs: list[Outcome] = results
    ok = all(o.ok for o in outs)
    first = next((o for o in outs if not o.ok and not o.stopped), None) or next((o for o in outs if not o.ok), None)
    run = outs[0].run.model_copy(update={"seconds": max(o.run.seconds for o in outs),
                                         "devices": tuple(d for o in outs for d in o.run.devices)})
    logs = [(lvl, f"[member {o.member}] {msg}") for o in outs for lvl, msg in o.logs]
    update: dict[str, Any] = {"ok": ok, "run": run, "logs": logs, "reports": [r for o in outs for r in o.reports]}
    if not ok and first is not None:
        update.update(error=first.error, error_type=first.error_type, stopped=first.stopped,
                      error_message=f"member {first.member} on {first.run.worker}: {first.error_message}",
                      error_text=first.error_text, value=b"")
    members = [{"member": o.member, "worker": o.run.worker, "name": o.run.name, "host": o.run.host,
                "devices": o.run.device_keys,
                "seconds": o.run.seconds, "ok": o.ok, "stopped": o.stopped} for o in outs]
    return outs[0].model_copy(update=update), members

