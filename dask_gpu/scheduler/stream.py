"""The cluster's queue on the batched streams: runs entered and answered without a connection held per waiting run,
and what a worker says of a body that ended or waits warm."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger("distributed.dask_gpu")
PLACED_STREAM_OP = "gpu-queue-placed"  # to the client, on its stream: where a run entered with ENTER_STREAM_OP goes


class QueueStream:
    """The queue plugin's stream handlers (a mixin of GPUQueuePlugin)."""

    def _leave_stream(self, id: str, client: str | None = None, **kwargs: Any) -> None:
        with _contained("leave", id):
            self.leave(id)

    def _cold_stream(self, body: str, worker: str | None = None, **kwargs: Any) -> None:
        with _contained("cold", body):
            self._cold(body, worker)

    def _freed_stream(self, id: str, worker: str | None = None, warm: str | None = None, keep: float = 0.0,
                      **kwargs: Any) -> None:
        """The worker a one-host run is placed on says its body ended: its devices go to the next run now, not after
        the control plane has fetched the result and left (a round trip or two later). Only that worker's word
        counts (a worker cannot free another's run); the client's own leave, later, finds nothing left to do."""
        with _contained("freed", id):
            self._freed(id, worker, warm, keep)

    def _freed(self, id: str, worker: str | None, warm: str | None = None, keep: float = 0.0) -> None:
        jid = self.keys.get(id)
        if worker is None or jid is None or jid in self.preempted:
            return
        if jid in self.running:
            run = self.running[jid][0]
            if len(run.hosts) != 1 or self.addresses[run.host] != worker:
                return
        elif jid not in self.fractions or self.fractions[jid][0] != worker:
            return
        if warm and self._park(jid, worker, warm, keep):  # its body stays warm, keeping its place
            self.keys.pop(id, None)
            self._dispatch_soon()
            return
        self.leave(id)

    def _enter_stream(self, key: str, client: str | None = None, **kwargs: Any) -> None:
        """`place`, asked on the client's batched stream and answered on it (PLACED_STREAM_OP, by `key`).

        Why: a run may wait hours, and an RPC held open per waiting run takes a connection of the client's
        pool each (512): past that nothing, not even a finished run's result, gets through. Here a waiting
        run costs a queue entry and one coroutine, and the client holds nothing.
        """
        kwargs.pop("op", None)
        asyncio.ensure_future(self._answer_on_stream(key, client or "", kwargs))

    async def _answer_on_stream(self, key: str, client: str, kwargs: dict[str, Any]) -> None:
        try:
            where = await self.place(key, client=client, **kwargs)
            msg: dict[str, Any] = {"op": PLACED_STREAM_OP, "key": key, "where": where}
        except Exception as exc:  # a bad entry: the client is told, never left waiting
            msg = {"op": PLACED_STREAM_OP, "key": key, "where": None, "error": f"{type(exc).__name__}: {exc}"}
        if self.scheduler is not None:
            self.scheduler.client_send(client, msg)


@contextmanager
def _contained(what: str, key: str) -> Iterator[None]:
    """A stream message the queue fails on is logged and dropped: an exception in a stream handler would close the
    whole stream, and with it the control plane's connection to the scheduler (every run on it lost)."""
    try:
        yield
    except Exception:
        logger.exception("the cluster's queue could not take %s of %s; dropped", what, key)
