"""A run the cluster's queue placed, handed straight to its worker (dask_gpu.worker.sandbox) instead of as a Dask task.

Why: the queue already chose the worker and the devices, so the Dask task added only its state machine on the
scheduler and the worker and a result fetched afterwards. The hand-over is one message on a TLS connection of the
control plane's to that worker, and the `Outcome` comes back on it. `HandedOver` gives the dispatcher the
face of a Dask future (done, a callback, the result), so a run is followed, stopped and settled as before; a
connection that breaks under the run is the worker lost (`WorkerUnreachable`, a KilledWorker: the run's worker
died, or cannot be reached, and its body is asked to stop wherever it still runs).

A run holds its connection for as long as it runs, so hand-overs have a pool of their own (`Handovers`), not the
Dask client's (512 connections, shared with fetching results). The plane first raises its soft open-file limit to
the hard one (as Ray's processes do: the common soft 1,024 would end a map of a few hundred runs on EMFILE, which
reads as the worker lost), then sizes the pool to half of what is left after the Dask client's connections and a
reserve for flows' HTTP connections and the ledger: a run past it waits for a connection instead of failing for
want of a file descriptor.
"""

from __future__ import annotations

import asyncio
import resource
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from types import SimpleNamespace
from typing import Any

from distributed import Client, KilledWorker
from distributed.core import ConnectionPool
from distributed.protocol.serialize import to_serialize

from dask_gpu.tickets import Ticket, TicketRejected
from dask_gpu.worker.sandbox import RUN_OP
from dask_gpu.worker.records import Body, Outcome


class WorkerUnreachable(KilledWorker):
    """The connection to the worker of a handed-over run broke before its outcome came back."""

    def __init__(self, key: str, address: str, cause: BaseException) -> None:
        super().__init__(key, SimpleNamespace(address=address), 0)
        self.cause = f"{type(cause).__name__}: {cause}"

    def __str__(self) -> str:
        return f"the connection to worker {self.last_worker.address} running {self.task!r} broke ({self.cause})"


class PlaneStopping(Exception):
    """The control plane closed its connections to its workers (it stops) while this run was on one."""


CLIENT_CONNECTIONS = 512  # the Dask client's own pool (distributed.Client's connection_limit)
RESERVED_FILES = 512  # flows' HTTP connections, the ledger's files, logs: what the plane needs besides its pools


def open_files_limit() -> int:
    """The process's soft open-file limit, raised to its hard limit first (an unprivileged process may)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # a hard limit past the kernel's nr_open: keep the soft one
            pass
    return soft


def pool_size(soft: int) -> int:
    """How many hand-overs may hold a connection at once under a soft open-file limit of `soft`.

    >>> pool_size(1024), pool_size(4096), pool_size(1 << 20)
    (64, 1536, 65536)
    """
    if soft == resource.RLIM_INFINITY:
        return 1 << 16
    return min(1 << 16, max(64, (soft - CLIENT_CONNECTIONS - RESERVED_FILES) // 2))


class Handovers:
    """The control plane's connections to its workers for runs handed over, on its Dask client's event loop."""

    def __init__(self, client: Client) -> None:
        self.limit = pool_size(open_files_limit())
        self.client = client
        self.pool: ConnectionPool | None = None  # made on the loop by the first hand-over
        self.closing = False

    def send(self, address: str, ticket: Ticket, body: Body, key: str) -> HandedOver:
        """Hand run `key` to the worker at `address`; followed as a future."""
        return HandedOver(self, address, ticket, body, key)

    async def call(self, address: str, **msg: Any) -> Any:
        if self.pool is None:  # on the loop: no await between the check and the pool's start
            c = self.client
            self.pool = ConnectionPool(limit=self.limit, connection_args=c.connection_args, deserialize=True,
                                       serializers=c._serializers, deserializers=c._deserializers)
            await self.pool.start()
        return await getattr(self.pool(address), RUN_OP)(**msg)

    def close(self) -> None:
        """Its connections closed (the workers stop the bodies still running on them)."""
        self.closing = True
        if self.pool is not None and self.client.status == "running":
            self.client.sync(self.pool.close)


class HandedOver:
    """One run sent to its worker (`Handovers`); what `Dispatcher._await` follows."""

    def __init__(self, handovers: Handovers, address: str, ticket: Ticket, body: Body, key: str) -> None:
        self.key, self.address = key, address
        self._future: Future = asyncio.run_coroutine_threadsafe(self._call(handovers, ticket, body),
                                                                handovers.client.loop.asyncio_loop)

    async def _call(self, handovers: Handovers, ticket: Ticket, body: Body) -> Outcome:
        try:
            out = await handovers.call(self.address, ticket=to_serialize(ticket), body=to_serialize(body), key=self.key)
        except PermissionError as exc:  # the worker's gate refused it: nothing ran, nothing is charged
            raise TicketRejected(f"worker {self.address} refused the hand-over of {self.key!r}: {exc}") from None
        except (OSError, EOFError) as exc:  # CommClosedError is an OSError; the worker sends its own as another type
            if handovers.closing:
                raise PlaneStopping(f"the control plane stopped while this run was on worker {self.address}") from None
            raise WorkerUnreachable(self.key, self.address, exc) from None
        if not isinstance(out, Outcome):  # a worker with no such handler answers None: it ran nothing
            raise TicketRejected(f"worker {self.address} answered {RUN_OP} for {self.key!r} with a "
                                 f"{type(out).__name__}, not an Outcome: it is older than this control plane. Fix: "
                                 "upgrade the worker, or set AISCHED_HAND_OVER_PLACED=false")
        return out

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        self._future.add_done_callback(lambda _: fn(self))

    def result(self) -> Outcome:
        try:
            return self._future.result()
        except CancelledError:
            raise WorkerUnreachable(self.key, self.address, CancelledError("the control plane stopped following it")) from None

    def cancel(self) -> None:
        """Stop following it (the caller asks its worker to stop the body: a cancelled call does not)."""
        self._future.cancel()

    def release(self) -> None:
        """Nothing to release: its outcome came back with the answer, nothing stays on the scheduler."""
