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
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
from distributed import Client, Future, KilledWorker

from aisched_prefect.control import stages
from aisched_prefect.control.admission import Admission, Admitter
from aisched_prefect.control.outcomes import direct_reply, result_evidence
from aisched_prefect.control.state import AuthorityState
from aisched_prefect.errors import AdmissionDenied, InvalidUsage
from aisched_prefect.ledger import BudgetAlert, Hold, Ledger
from aisched_prefect.settings import Settings
from aisched_prefect.usage import ReportedUsage, reported
from aisched_prefect.wire import Reply
from blocks import MAX_AMOUNT, BudgetBlock, ModelLimit, UnpriceableRequest, Usage
from dask_gpu import WorkerDied, WorkerInventory, cluster_inventories, request_stop
from dask_gpu.errors import StopRequested
from dask_gpu.limits import RELEASE_STREAM_OP as LIMIT_RELEASE_STREAM_OP
from dask_gpu.queue_plugin import ENTER_STREAM_OP, LEAVE_STREAM_OP, PLACED_STREAM_OP
from dask_gpu.sandbox import Body, Outcome, run_ticketed
from dask_gpu.tickets import DIED_TOPIC, STATES_OP, WHERE_OP, Ticket, TicketRejected, TicketSigner

logger = logging.getLogger("aisched_prefect.control")
# A run handed to Dask whose key the scheduler still does not know after this long is lost (its worker took it
# along unseen). Not sooner: a scheduler busy with a burst (a .map() of 10,000) may take seconds to see a submit.
VANISHED_SECONDS = 30.0


@dataclass(frozen=True)
class Placement:
    """Where a run goes: its workers (a gang: member 0 first), the devices chosen on each (None: the worker
    chooses) and what each member holds."""

    workers: list[str]
    devices: list[list[str]] | None = None
    shares: list[float] = field(default_factory=list)


class Lost(Exception):
    """The worker (or one member's worker) running a run died under it (inside the dispatcher; the flow gets
    dask_gpu.WorkerDied)."""

    def __init__(self, lost: dict[str, Any]) -> None:
        self.lost = lost
        super().__init__(f"worker {lost.get('name') or lost.get('worker')} died")


@dataclass
class Running:
    """One admitted run between its hand-over to Dask and its settlement, as the watcher sees it."""

    admission: Admission
    key: str
    holds: list[Hold]
    covered_seconds: float
    submitted: float  # monotonic
    extra_cost: float = 0.0
    started_at: float | None = None
    top_up_refused: str | None = None
    stop_reason: str | None = None
    queue_id: str | None = None
    preempted_for: str | None = None
    placed: bool = False
    asked: set[float] = field(default_factory=set)
    model_limit: dict[str, Any] | None = None  # which model limit it waited for, and how long
    settled: bool = False  # set (under `holds_lock`) as its holds are read for settlement: no top-up after that
    holds_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    members: list[str] = field(default_factory=list)  # a gang's Dask keys, member 0 first (empty: `key` alone)
    placement: Placement | None = None  # where the queue (or the gang placement) put it
    ticket: Ticket | None = None
    dask_at: float | None = None  # monotonic time it was handed to Dask
    lost: dict[str, Any] | None = None  # the worker that died under it: worker, name, devices, keys
    wake: threading.Event = field(default_factory=threading.Event, repr=False)
    call_key: str = ""  # the control plane's key of the call it serves

    @property
    def dask_keys(self) -> list[str]:
        """The Dask keys it runs under: its own, or one per gang member."""
        return self.members or [self.key]

    def add_holds(self, reserve: Any, seconds: float = 0.0, cost: float = 0.0) -> bool:
        """Take a top-up (`reserve()` returns its holds) covering `seconds` more, unless the run is being settled;
        False if it was. Holds and cover change together, under the lock its settlement reads them under."""
        with self.holds_lock:
            if self.settled:
                return False
            self.holds.extend(reserve())
            self.covered_seconds += seconds
            self.extra_cost += cost
            return True


@dataclass(frozen=True)
class BodyParts:
    """An admitted call's body while it waits: its function's pickle (shared by the runs of one `.map()`) and its
    arguments', joined into the `Body` Dask carries only when the run is handed over."""

    fn: bytes
    args: bytes
    modules: tuple[str, ...] = ()

    def body(self) -> Body:
        return Body(payload=self.fn + self.args, modules=list(self.modules))


class ModelSlotUnavailable(Exception):
    """The cluster's scheduler could not give a model call its rate or concurrency slot (no model-limits plugin)."""


class Preempted(Exception):
    """The cluster's queue stopped a run to give borrowed GPUs back; it was charged and will queue again."""


class Dispatcher:
    """Everything that touches Dask, and the table of running work the watcher keeps honest."""

    def __init__(self, client: Client, signer: TicketSigner, ledger: Ledger, state: AuthorityState, settings: Settings,
                 queue: bool = True) -> None:
        self.client, self.signer, self.ledger, self.state, self.settings = client, signer, ledger, state, settings
        self.queue = queue
        self.running: dict[str, Running] = {}
        self.lock = threading.Lock()
        self._inventories: dict[str, WorkerInventory] = {}
        self._inventories_at = 0.0
        self._inv_lock = threading.Lock()
        self._gang_lock = threading.Lock()  # queue off: one gang at a time looks for whole idle workers
        client.subscribe_topic(DIED_TOPIC, self._on_worker_died)  # the ticket registry names what a dead worker took
        # Runs waiting in the cluster's queue: answered on the client's stream (no thread, no connection each).
        self._entered: dict[str, tuple[Running, Callable[[Placement | None], None]]] = {}
        self._calls: set[str] = set()  # call keys this replica follows, queued or running
        client._stream_handlers[PLACED_STREAM_OP] = self._on_placed

    # -- inventory ------------------------------------------------------------------------
    def inventories(self, fresh: bool = False) -> dict[str, WorkerInventory]:
        with self._inv_lock:
            if fresh or time.monotonic() - self._inventories_at > self.settings.inventory_ttl_seconds or not self._inventories:
                self._inventories = cluster_inventories(self.client)
                self._inventories_at = time.monotonic()
            return self._inventories

    # -- pricing --------------------------------------------------------------------------
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
            self.ledger.record("settlement", {**base_payload(adm), **payload, "settlements": []}, **adm.ids)
            return
        self.ledger.settle([h.id for h in holds], charges, kind="settlement",
                           payload={**base_payload(adm), **payload}, **adm.ids)

    # -- running --------------------------------------------------------------------------
    def launch(self, admission: Admission, body: BodyParts, admitter: Admitter,
               done: Callable[[Reply, bytes], None], call_key: str = "") -> str:
        """Start an admitted run and return at once; `done(reply, out)` is called once, however it ends.

        A GPU run waits in the cluster's queue as state (an entry on the scheduler, a row and a `Running`
        here): no thread and no connection is held for it until the queue starts it; from then on one
        thread follows it to its settlement, so threads scale with the runs executing. Runs the queue does
        not place (no GPUs, a model call waiting for its model's limit, the queue off) take that thread at once.
        """
        if call_key:
            with self.lock:
                self._calls.add(call_key)
            inner = done

            def done(reply: Reply, out: bytes) -> None:
                with self.lock:
                    self._calls.discard(call_key)
                inner(reply, out)

        if self.queue and admission.request.gpus > 0 and self._model_limit(admission) is None:
            state = self._register(admission)
            state.call_key = call_key
            self._enter_queue(state, lambda placement: self._spawn(
                self._run_placed, state, placement, body, admitter, done))
            return state.key
        self._spawn(self._run_blocking, admission, body, admitter, done)
        return ""

    def has_call(self, call_key: str) -> bool:
        """Whether this replica still follows the call (queued or running): a flow may re-attach to it."""
        with self.lock:
            return call_key in self._calls

    def abandon(self, call_keys: set[str]) -> int:
        """Take the waiting runs of these calls out of the queue (their flow process went away); how many."""
        with self.lock:
            keys = [r.key for r in self.running.values() if r.call_key in call_keys and not r.placed]
        if keys:
            self.stop(keys, "abandoned")
        return len(keys)

    @staticmethod
    def _spawn(fn: Callable[..., None], *args: Any) -> None:
        threading.Thread(target=fn, args=args, name="aisched-run", daemon=True).start()

    def _run_blocking(self, admission: Admission, body: BodyParts, admitter: Admitter,
                      done: Callable[[Reply, bytes], None]) -> None:
        try:
            reply, out = self.execute(admission, body.body(), admitter)
        except BaseException as exc:  # noqa: BLE001 - the caller gets a reply whatever happened
            reply, out = _crashed(admission, exc), b""
        done(reply, out)

    def _run_placed(self, state: Running, placement: Placement | None, body: BodyParts, admitter: Admitter,
                    done: Callable[[Reply, bytes], None]) -> None:
        """The queue started (or dropped) a run entered by `launch`: hand it to Dask and follow it to its end."""
        admission = state.admission
        try:
            try:
                reply, out = self._submit(state, body.body(), admission.workers, admission.request.gpu_request(),
                                          placement=placement)
            finally:
                with self.lock:
                    self.running.pop(state.key, None)
        except Preempted:  # charged for what ran; admitted again and queued again, as state
            try:
                again = admitter.readmit(admission, "preempted")
            except BaseException as exc:  # noqa: BLE001
                done(_crashed(admission, exc), b"")
                return
            self.launch(again, body, admitter, done)
            return
        except BaseException as exc:  # noqa: BLE001
            reply, out = _crashed(admission, exc), b""
        done(reply, out)

    def _register(self, admission: Admission) -> Running:
        key = f"aisched-{admission.task_name}-{admission.task_run_id}-{uuid.uuid4().hex[:8]}"
        state = Running(admission=admission, key=key, holds=list(admission.holds),
                        covered_seconds=admission.request.est_seconds, submitted=time.monotonic())
        with self.lock:
            self.running[key] = state
        return state

    def _enter_queue(self, state: Running, on_placed: Callable[[Placement | None], None]) -> None:
        """Queue the run on the client's batched stream; the queue answers on it when it starts the run."""
        state.queue_id = uuid.uuid4().hex
        with self.lock:
            self._entered[state.queue_id] = (state, on_placed)
        self.client._send_to_scheduler({"op": ENTER_STREAM_OP, "key": state.queue_id, **self._queue_args(state)})

    def _on_placed(self, key: str, where: dict[str, Any] | None, error: str | None = None, **_: Any) -> None:
        """The queue's answer (in the client's event loop): start the run's thread, or end it if it left."""
        with self.lock:
            entry = self._entered.pop(key, None)
        if entry is None:
            if where is not None:  # nobody waits for it any more (it was stopped meanwhile): give it back
                self.client._send_to_scheduler({"op": LEAVE_STREAM_OP, "id": key})
            return
        state, on_placed = entry
        if error:
            logger.error("the cluster's queue refused run %s: %s", state.key, error)
        state.placed = where is not None
        if where is None:
            state.queue_id = None
        on_placed(None if state.stop_reason or where is None else Placement(**where))

    def reenter_waiting(self) -> int:
        """Queue every waiting run again (the scheduler restarted and its queue is new); how many."""
        with self.lock:
            waiting = list(self._entered.items())
        for old, (state, on_placed) in waiting:
            with self.lock:
                if self._entered.pop(old, None) is None:
                    continue
            self._enter_queue(state, on_placed)
        return len(waiting)

    def waiting(self) -> int:
        with self.lock:
            return len(self._entered)

    def execute(self, admission: Admission, body: Body, admitter: Admitter) -> tuple[Reply, bytes]:
        """Run an admitted call; a run the cluster's queue preempts is charged for what ran and queued again."""
        requeued = 0
        while True:
            try:
                return self._execute_once(admission, body)
            except Preempted:
                requeued += 1
                admission = admitter.readmit(admission, f"preempted ({requeued})")

    def _ticket(self, admission: Admission, attempt_key: str, shares: list[int] | None = None,
                workers: list[str] | None = None) -> Ticket:
        request = admission.request.gpu_request()
        if shares:  # a gang: the ticket names how many members there are and what each holds
            request = request.model_copy(update={"hosts": len(shares)})
        return self.signer.issue(run=f"{admission.id}/{attempt_key}", payload_digest=admission.payload_digest,
                                 code_digest=admission.code_digest, request=request,
                                 ttl_seconds=self.settings.ticket_ttl_seconds,
                                 lease_seconds=self.settings.body_lease_seconds,
                                 hosts=len(shares) if shares else 1, shares=shares or (), tenant=admission.tenant,
                                 workers=tuple(workers or ()))

    def _execute_once(self, admission: Admission, body: Body) -> tuple[Reply, bytes]:
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
                return self._submit(state, body, workers, gpu_request)
        except ModelSlotUnavailable as exc:  # it never ran: void its holds
            self.settle(state, None, {"outcome": "model-limit-unavailable", "error": str(exc)})
            return denied("model-limit", f"the call could not get a slot under its model's limit ({exc})",
                          "check that the cluster's scheduler carries the model limits (dask-gpu-scheduler preloads "
                          "them; `aisched serve` installs them)"), b""
        finally:
            with self.lock:
                self.running.pop(key, None)

    def _is_gang(self, admission: Admission) -> bool:
        req = admission.request.gpu_request()
        if req.hosts is not None or req.gpus < 1:
            return (req.hosts or 1) > 1
        inventories = self.inventories()
        return not any(req.fits(inventories[w]) for w in admission.workers if w in inventories)

    def _submit(self, state: Running, body: Body, workers: list[str] | None, gpu_request: Any,
                placement: Placement | None | str = "wait") -> tuple[Reply, bytes]:
        """Hand the run to Dask and follow it; `placement`: where the queue already started it (None: it left the
        queue), or "wait" to wait in the queue here."""
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
                if state.placement is None:
                    self.settle(state, None, {"outcome": "revoked-while-queued"})
                    return denied("revocation", f"a grant in the chain {admission.chain} was revoked while the run "
                                  "waited in the cluster's queue", "ask for a new grant"), b""
            futures = self._hand_over(state, body, workers, gpu_request, gang)
            try:
                results = self._await(state, futures)
            finally:
                for f in futures:
                    f.release()
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
            devices = place.devices[0] if place is not None and place.devices else None
            state.ticket = self._ticket(state.admission, state.key,
                                        workers=place.workers if place is not None else workers)
            state.dask_at = time.monotonic()
            # Its worker frees its place in the queue as its body ends; a preemptible run's leave must say whether
            # the queue stopped it, so the control plane keeps that one.
            freed = state.queue_id if place is not None and not state.admission.request.preemptible else None
            return [self.client.submit(
                run_ticketed, state.ticket, body.model_copy(update={"devices": devices, "queue_key": freed}), key=state.key,
                resources=gpu_request.resources() or None, workers=place.workers if place is not None else workers,
                allow_other_workers=False, pure=False)]
        assert place is not None
        shares = [int(x) for x in place.shares]
        state.ticket = ticket = self._ticket(state.admission, state.key, shares, workers=place.workers)
        state.members = [f"{state.key}-m{i}" for i in range(len(place.workers))]
        state.dask_at = time.monotonic()
        return [self.client.submit(
            run_ticketed, ticket, body.model_copy(update={"member": i, "devices": place.devices[i] if place.devices else None}),
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
                break
            if state.lost is not None:  # its worker is gone: whatever Dask does next, this attempt is over
                self.client.cancel([f for f in futures if not f.done()], force=True)
                if len(futures) > 1:
                    request_stop(self.client, state.dask_keys)
                raise Lost(state.lost)
            if len(futures) > 1 and not stopping and any(_failed(r) for r in results.values()):
                stopping = True  # one member failed: the gang cannot go on
                request_stop(self.client, [k for i, k in enumerate(state.dask_keys) if i not in results])
            state.wake.wait(5.0)
            state.wake.clear()
        return [results[i] for i in range(len(futures))]

    def _on_worker_died(self, event: tuple[float, dict[str, Any]]) -> None:
        """The ticket registry's event: a worker left while these runs were on it (runs in the client's loop)."""
        msg = event[1]
        devices = {r["key"]: r.get("devices", []) for r in msg.get("runs", [])}
        keys = set(msg.get("keys", [])) | set(devices)
        with self.lock:
            for r in self.running.values():
                hit = [k for k in r.dask_keys if k in keys]
                if hit and r.lost is None:
                    r.lost = {"worker": msg.get("worker"), "name": msg.get("name"), "keys": hit,
                              "devices": [d for k in hit for d in devices.get(k, [])], "expected": msg.get("expected")}
                    r.wake.set()

    def check_stuck(self, running: dict[str, Running]) -> None:
        """The backstop of `_on_worker_died` (the watcher calls it): a run whose task waits in `no-worker` (pinned
        to a worker that died) or vanished from the scheduler is ended as lost, whatever events it missed."""
        keys = {k: r for r in running.values() if r.dask_at is not None and r.lost is None for k in r.dask_keys}
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
                          "devices": member.get("devices", []), "found": st["state"] if st else "gone"}
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
            "keys": [lost.get("key")] if lost.get("key") else []}

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
        self.ledger.record("worker-died", {**base_payload(adm), "worker": lost.get("worker"), "name": lost.get("name"),
                                           "devices": lost.get("devices", []), "keys": lost.get("keys", []),
                                           "seconds": ran}, **adm.ids)
        who = lost.get("name") or lost.get("worker") or "?"
        lost_devices = ",".join(lost.get("devices") or []) or "?"
        self.settle(state, charges, {"outcome": "worker-died", "error": f"worker {who} died while it ran the task",
                                     "seconds": ran, "attempts": attempts, "charges": charges,
                                     "placement": {"worker": lost.get("worker"), "name": lost.get("name"),
                                                   "devices": lost.get("devices", [])}})
        logger.warning("AI task %s: worker %s died under it after %.1fs (devices %s); charged for that",
                       adm.task_name, who, ran, lost_devices)
        message = (f"the worker {who} running this task died (devices {lost_devices} lost); it was charged for at "
                   f"most {ran:.1f}s")
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
        self.settle(state, charges, {"outcome": "scheduler-lost", "error": message, "seconds": ran, "charges": charges})
        logger.warning("AI task %s: %s", adm.task_name, message)
        return Reply(status="failed", admission=adm.id, error_type="aisched_prefect.errors.SchedulerLost",
                     error_message=message), cloudpickle.dumps(SchedulerLost(message))

    def resubscribe(self) -> None:
        """After a reconnect: the worker-death events and the queue's answers again (a new scheduler knows neither)."""
        self.client.subscribe_topic(DIED_TOPIC, self._on_worker_died)
        self.client._stream_handlers[PLACED_STREAM_OP] = self._on_placed

    def _place_gang(self, state: Running) -> Placement | None:
        """The queue is off: whole workers for a gang, once enough of them are idle (one gang looks at a time)."""
        from dask_gpu import cluster_view
        from dask_gpu.request import split

        adm = state.admission
        req = adm.request.gpu_request()
        with self._gang_lock:
            while state.stop_reason is None:
                idle = [w for w in cluster_view(self.client)
                        if w.name in adm.workers and not w.held and all(u == 0 for u, _ in w.usage.values())]
                fitting = {w.name: req.fitting(w.inventory) for w in idle}
                if req.hosts:
                    chosen = [w for w in idle if fitting[w.name] >= int(req.gpus) // req.hosts][: req.hosts]
                    shares = [int(req.gpus) // req.hosts] * req.hosts if len(chosen) == req.hosts else None
                else:
                    chosen, got = [], 0
                    for w in sorted(idle, key=lambda w: -fitting[w.name]):
                        if got >= req.gpus:
                            break
                        chosen.append(w)
                        got += fitting[w.name]
                    shares = split(int(req.gpus), [fitting[w.name] for w in chosen])
                if shares:
                    return Placement(workers=[w.address for w in chosen], devices=None, shares=shares)
                time.sleep(0.5)
        return None

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
            outcome = "completed" if out.ok else f"stopped-{stopped}" if stopped else "failed"
        else:  # what it used is unknown: charge what it held, and return no result
            charges, outcome, stopped = held_by_account(state.holds), "failed", None
            out = out.model_copy(update={"ok": False, "error_type": "aisched_prefect.errors.InvalidUsage",
                                         "error_message": str(bad_usage), "error_text": str(bad_usage),
                                         "error": cloudpickle.dumps(bad_usage), "value": b""})
        placement = {"worker": run.worker, "name": run.name, "host": run.host, "devices": run.device_keys,
                     "gpu_type": run.gpu_type,
                     "source": run.source,
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
            **(result_evidence(out.value, out.result) if out.ok else {})})
        if stopped == "preempted":
            logger.warning("AI task %s was preempted after %.1fs to give tenant %r its quota back; charged for that "
                           "and queued again", adm.task_name, run.seconds, state.preempted_for)
            raise Preempted()
        common = {"admission": adm.id, "logs": out.logs, "placement": placement, "charged": charges}
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

    # -- the cluster's queue ----------------------------------------------------------------
    def _queue_args(self, state: Running) -> dict[str, Any]:
        """What the cluster's queue is told of a run (its `place` arguments, but the key and the client)."""
        adm = state.admission
        req = adm.request.gpu_request()
        return dict(tenant=adm.tenant, gpus=req.gpus if req.fractional else int(req.gpus),
                    estimate=adm.request.est_seconds, priority=adm.priority, workers=adm.workers,
                    preemptible=adm.request.preemptible, task=state.key if adm.request.preemptible else None,
                    width=req.hosts if (req.hosts or 1) > 1 else 0, types=list(req.types) if req.types else None,
                    memory=req.gpu_memory_gb)

    def _wait_in_queue(self, state: Running) -> Placement | None:
        """Wait in the cluster's one queue (a scheduler plugin) until the policy starts the run: its workers and
        devices. One round trip, held open while it waits: only for runs `launch` does not enter on the stream."""
        state.queue_id = uuid.uuid4().hex  # known before the call, so a stop can take it out of the queue
        where = self.client.sync(self.client.scheduler.gpu_queue_place, key=state.queue_id, client=self.client.id,
                                 **self._queue_args(state))
        state.placed = where is not None
        if where is None:
            state.queue_id = None
        return None if state.stop_reason or where is None else Placement(**where)

    def _leave_queue(self, state: Running) -> None:
        if state.queue_id is None:
            return
        if state.admission.request.preemptible:  # it must learn whether the queue stopped it: one round trip
            state.preempted_for = self.client.sync(self.client.scheduler.gpu_queue_leave, id=state.queue_id)
        else:  # on the client's batched stream: no round trip
            self.client._send_to_scheduler({"op": LEAVE_STREAM_OP, "id": state.queue_id})
        state.queue_id = None

    def stop(self, keys: list[str], reason: str) -> None:
        queued = []
        with self.lock:
            for k in keys:
                r = self.running.get(k)
                if r is not None and r.stop_reason is None:
                    r.stop_reason = reason
                    r.wake.set()  # a wait for a model slot ends at once
                    if r.queue_id is not None and not r.placed:
                        queued.append(r.queue_id)
        for queue_id in queued:  # still in the cluster's queue: take it out, its wait returns no worker
            self.client._send_to_scheduler({"op": LEAVE_STREAM_OP, "id": queue_id})
        with self.lock:
            dask_keys = [k for key in keys for k in (self.running[key].dask_keys if key in self.running else [key])]
        request_stop(self.client, dask_keys)

    # -- model-call limits ---------------------------------------------------------------------
    def _model_limit(self, admission: Admission) -> ModelLimit | None:
        if admission.request.kind != "model-call":
            return None
        bound = self._bound(admission)
        return bound.cluster.model.limit_for(admission.request.model) if bound.cluster else None

    @contextmanager
    def _model_slot(self, state: Running) -> Iterator[None]:
        """Wait for the model's concurrency and rate slots (admitted runs only), hold the slot while it runs.

        The limits live where the queue lives: the scheduler's model-limits plugin (`dask_gpu.limits`), shared by
        every control plane replica of the cluster. Concurrency slots go first come, first served; each start gets
        its own slot time, 60/per_minute apart, so a burst runs at the configured rate. The wait is asked in turns
        of a second and slept on the run's wake event, so a revocation ends it at once (the caller sees
        `stop_reason`). How long the call waited, its slot time and how much of the wait was for its rate slot
        (`rate_wait`: 0 when it asked after the previous slot) go into its settlement (`model_limit`).
        """
        lim = self._model_limit(state.admission)
        if lim is None:
            yield
            return
        t0 = time.monotonic()
        key = uuid.uuid4().hex
        sched = self.client.scheduler
        got: dict[str, float] | None = None
        try:
            while state.stop_reason is None and got is None:
                got = self.client.sync(sched.gpu_limit_acquire, name=lim.slug, per_minute=lim.per_minute,
                                         concurrency=lim.concurrency, client=self.client.id, wait=1.0, key=key)
            if got is None and lim.concurrency is not None:  # its authority ended while it waited: out of line
                self.client.sync(sched.gpu_limit_cancel, name=lim.slug, client=self.client.id, key=key)
        except Exception as exc:
            raise ModelSlotUnavailable(f"model limit {lim.model!r}: {type(exc).__name__}: {exc}") from exc
        if got is None:  # it never took a slot (the caller sees `stop_reason`)
            yield
            return
        start = time.monotonic() + got["delay"]  # slept on this clock: the scheduler's wall clock may differ
        unrate: dict[str, float] = {}
        try:
            while state.stop_reason is None and (left := start - time.monotonic()) > 0:  # its start slot
                state.wake.wait(left)
                state.wake.clear()
            if state.stop_reason is not None and lim.per_minute is not None:  # it will not start: the slot back
                unrate = {"unrate": got["slot"], "per_minute": lim.per_minute}
            state.model_limit = {"limit": lim.model, "waited": time.monotonic() - t0, "slot": got["slot"],
                                 "rate_wait": got["delay"]}
            state.submitted = time.monotonic()  # what ran is counted from here, not from the wait
            yield
        finally:  # on the client's batched stream: no round trip
            self.client._send_to_scheduler({"op": LIMIT_RELEASE_STREAM_OP, "name": lim.slug, **unrate})


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


def held_by_account(holds: list[Hold]) -> dict[str, float]:
    """What the holds cover, per account: the charge of a run whose outcome is unknown."""
    out: dict[str, float] = {}
    for h in holds:
        out[h.budget] = out.get(h.budget, 0.0) + h.reserved
    return out


def base_payload(adm: Admission) -> dict[str, Any]:
    return {"task": adm.task_name, "flow": adm.flow_name, "tenant": adm.tenant,
            "request": adm.request.model_dump(mode="json"), "chain": adm.chain, "grant": adm.chain[-1] if adm.chain else None,
            "admission": adm.id, **({"approval_digest": adm.approval_digest} if adm.approval_digest else {})}


def _scheduler_gone(exc: BaseException, client: Client) -> bool:
    """Whether `exc` is Dask cancelling a run because the client lost its scheduler (not a stop of ours)."""
    return "scheduler-connection-lost" in f"{exc!r} {exc}" or (
        type(exc).__name__ in ("CancelledError", "FutureCancelledError") and client.status != "running")


def _crashed(adm: Admission, exc: BaseException) -> Reply:
    """A run whose dispatch raised: its reply names the cause (never a bare error without one)."""
    logger.error("AI task %s (admission %s) ended by %s: %s", adm.task_name, adm.id, type(exc).__name__, exc)
    return Reply(status="failed", admission=adm.id, error_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
                 error_message=f"the control plane could not run it: {type(exc).__name__}: {exc}")


def denied(stage: str, reason: str, fix: str) -> Reply:
    return Reply(status="denied", stage=stage, reason=reason, fix=fix)


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
