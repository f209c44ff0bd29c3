"""How admitted runs wait: in the cluster's one queue as state (an entry on the scheduler, a row here), and
leave it; a gang's whole workers when the queue is off."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from aisched_prefect.control.admission.record import Admission, Readmitter
from aisched_prefect.control.admission.capacity import waits_for_capacity
from aisched_prefect.control.dispatch.outlast import outlasting
from aisched_prefect.control.dispatch.running import BodyParts, Placement, Preempted, Running, _crashed, denied
from aisched_prefect.control.dispatch.time_limit import TimeLimitRequeue, time_limit_args
from aisched_prefect.control.dispatch.warm import warm_key
from aisched_prefect.errors import AdmissionDenied
from aisched_prefect.ledger import Hold
from aisched_prefect.request import AIRequest
from aisched_prefect.wire import Reply
from dask_gpu import StopRequested, end_warm, request_stop
from dask_gpu.scheduler.queue import ENTER_STREAM_OP, LEAVE_STREAM_OP

logger = logging.getLogger("aisched_prefect.control")


class Queueing:
    """The dispatcher's part that enters runs in the cluster's queue and follows them out (a mixin of Dispatcher)."""

    def launch(self, admission: Admission, body: BodyParts, admitter: Readmitter,
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
            if waits_for_capacity(admission.workers):  # its flow's log gets what it waited for, in Slurm's words
                done = self._with_capacity_lines(state.key, admission.task_name, done)
            state.call_key = call_key
            self._enter_queue(state, lambda placement: self._spawn(
                self._run_placed, state, placement, body, admitter, done))
            if waits_for_capacity(admission.workers):  # only a job the scaler is to start holds it
                self.follow_capacity(state)
            return state.key
        self._spawn(self._run_blocking, admission, body, admitter, done)
        return ""

    def defers(self, request: AIRequest) -> bool:
        """Whether the cluster's queue starts runs of this request (a GPU run, the queue on): a map's later shards of
        it hold their budget when the queue starts them, not while they wait."""
        return bool(self.queue) and request.gpus > 0

    def _hold_at_start(self, state: Running, admitter: Readmitter | None) -> Reply | None:
        """Take the hold of a map's shard the queue just started (authority and budget as they are now); its
        refusal (recorded as a denial naming the shard) is its reply, and it is settled with nothing held."""
        assert admitter is not None, "a run that holds at its start is started with its admitter"
        adm0, tries = state.admission, []

        def take() -> Admission:  # through a ledger restart, as a settlement is; a commit of unknown outcome is
            tries.append(1)       # looked for before the hold is taken again
            return (len(tries) > 1 and self._held_before(adm0)) or admitter.hold_at_start(adm0)

        try:
            adm = outlasting(take, patience=self.settle_patience(),  # type: ignore[attr-defined]
                             what=f"AI task {adm0.task_name} (admission {adm0.id}) started")
        except AdmissionDenied as exc:
            self.settle(state, None, {"outcome": "refused-at-start", "stage": exc.stage, "error": exc.reason})
            if state.placement is not None and state.placement.body:  # the queue gave it an idle body: end it, or
                try:  # it would keep its devices while the queue counts them free once the run leaves
                    end_warm(self.client, [state.placement.body],  # type: ignore[attr-defined]
                             f"the run placed on it was refused as it started ({exc.stage})")
                except Exception as lost:  # noqa: BLE001 - the body still ends at its keep-warm time
                    logger.warning("could not end warm body %s: %s", state.placement.body, lost)
            return denied(exc.stage, exc.reason, exc.fix)
        with state.holds_lock:  # the watcher renews what `holds` lists from now on
            state.admission, state.holds = adm, list(adm.holds)
        return None

    def _held_before(self, adm: Admission) -> Admission | None:
        """The shard's hold, where an earlier try's commit went through though its answer was lost."""
        for r in reversed(self.ledger.records_about(adm.task_run_id)):  # type: ignore[attr-defined]
            if r.kind == "shard-hold" and r.payload.get("admission") == adm.id:
                return adm.model_copy(update={"holds": [Hold.model_validate(h) for h in r.payload["holds"]],
                                              "hold_at_start": False})
        return None

    def _with_capacity_lines(self, key: str, task: str,
                             done: Callable[[Reply, bytes], None]) -> Callable[[Reply, bytes], None]:
        def said_first(reply: Reply, out: bytes) -> None:
            lines = [(logging.WARNING, f"AI task {task} waited for capacity: {line}")
                     for line in self.capacity_said(key)]  # type: ignore[attr-defined]
            done(reply.model_copy(update={"logs": [*lines, *reply.logs]}) if lines else reply, out)

        return said_first

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

    def _run_blocking(self, admission: Admission, body: BodyParts, admitter: Readmitter,
                      done: Callable[[Reply, bytes], None]) -> None:
        try:
            reply, out = self.execute(admission, body.body(), admitter)
        except BaseException as exc:  # noqa: BLE001 - the caller gets a reply whatever happened
            reply, out = _crashed(admission, exc), b""
        done(reply, out)

    def _run_placed(self, state: Running, placement: Placement | None, body: BodyParts, admitter: Readmitter,
                    done: Callable[[Reply, bytes], None]) -> None:
        """The queue started (or dropped) a run entered by `launch`: hand it to Dask and follow it to its end."""
        admission = state.admission
        try:
            try:
                reply, out = self._submit(state, body.body(), admission.workers, admission.request.gpu_request(),
                                          placement=placement, admitter=admitter)
            finally:
                with self.lock:
                    self.running.pop(state.key, None)
        except Preempted as stopped:  # charged for what ran; admitted again and queued again, as state
            ran = self.ran_before.pop(admission.id, 0.0)
            limit = isinstance(stopped, TimeLimitRequeue)  # at its time limit: it resumes from its own checkpoint
            try:
                again = admitter.readmit(admission, "time-limit" if limit else "preempted")
            except BaseException as exc:  # noqa: BLE001
                done(_crashed(admission, exc), b"")
                return
            if limit or ran:
                self.ran_before[again.id] = ran + (stopped.seconds if limit else 0.0)  # the queue learns all it ran
            self.launch(again, body, admitter, done)
            return
        except StopRequested as exc:  # stopped as it was handed to its worker (a revocation): said as a stop, why
            reply = (Reply(status="stopped", admission=admission.id, reason=f"{state.stop_reason} ({exc})")
                     if state.stop_reason else _crashed(admission, exc))
            out = b""
        except BaseException as exc:  # noqa: BLE001
            reply, out = _crashed(admission, exc), b""
        self.ran_before.pop(admission.id, None)
        done(reply, out)

    def _register(self, admission: Admission) -> Running:
        key = f"aisched-{uuid.uuid4().hex}"
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

    def _queue_args(self, state: Running) -> dict[str, Any]:
        """What the cluster's queue is told of a run (its `place` arguments, but the key and the client)."""
        adm = state.admission
        req = adm.request.gpu_request()
        return dict(tenant=adm.tenant, gpus=req.gpus if req.fractional else int(req.gpus),
                    estimate=adm.request.est_seconds, priority=adm.priority, workers=adm.workers,
                    preemptible=adm.request.preemptible, task=state.key if adm.request.preemptible else None,
                    width=req.hosts if (req.hosts or 1) > 1 else 0, types=list(req.types) if req.types else None,
                    memory=req.gpu_memory_gb, warm=warm_key(adm) if self.keep_warm(adm) else None,
                    **time_limit_args(adm, self.ran_before.get(adm.id, 0.0)))

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

