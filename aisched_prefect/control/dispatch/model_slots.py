"""Model-call limits, for the dispatcher: a call waits for its model's concurrency and rate slots."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from aisched_prefect.control.admission.record import Admission
from aisched_prefect.control.dispatch.running import ModelSlotUnavailable, Running
from blocks import ModelLimit
from dask_gpu.scheduler.limits import RELEASE_STREAM_OP as LIMIT_RELEASE_STREAM_OP


class ModelSlots:
    """The dispatcher's part that takes a model call's slots (a mixin of Dispatcher)."""

    def _model_limit(self, admission: Admission) -> ModelLimit | None:
        if admission.request.kind != "model-call":
            return None
        bound = self._bound(admission)
        return bound.cluster.model.limit_for(admission.request.model) if bound.cluster else None

    @contextmanager
    def _model_slot(self, state: Running) -> Iterator[None]:
        """Wait for the model's concurrency and rate slots (admitted runs only), hold the slot while it runs.

        The limits live where the queue lives: the scheduler's model-limits plugin (`dask_gpu.scheduler.limits`), shared by
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

