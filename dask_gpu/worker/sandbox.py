"""How admitted work enters this worker: `run_ticketed`, a body's life on this worker as one pass, as a Dask task
or handed over by the control plane (`Handover`, the `gpu_run` handler).

`run_ticketed` is what the control plane sends, with a ticket and the `Body` it was signed for. It calls the
steps of dask_gpu.worker.life in order, each a function of the run's case:

1. redeem the ticket (verified, redeemed once in the cluster and once here),
2. take a warm body or fork one from its tenant's zygote,
3. contain a fresh one (its network, its devices, its cgroup),
4. hold its devices for the run,
5. meet the gang (a multi-host run),
6. run it (stopped when asked, when its lease lapses, at its time limit),
7. keep it warm or end it,
8. free its place in the cluster's queue,

and returns the `Outcome`. The body and its result stay bytes here: the worker and the control plane
never unpickle what a flow sent. A large result does not even travel as the
task's value: the worker keeps it (dask_gpu.worker.results) and the outcome carries
its digest, size and a one-time reference its caller fetches it with.

Why a hand-over: a run the cluster's queue placed has its worker and devices chosen already, so a Dask task added
only its state machine, on the scheduler and on the worker, and a result fetched afterwards (in a 10,000-shard map,
most of the workers' and a third of the scheduler's CPU a shard). Handed over, it is one message from the control
plane to that worker and its `Outcome` back on the same connection, as a Dask actor's call travels: the same pass,
under the key the control plane names (the key its Dask task would have had), stopped by `gpu_stop`, renewed by
`gpu_renew`. Only the control plane's certificate may ask for it (dask_gpu.gate). Gangs and runs the queue did not
place still go as Dask tasks.
"""

from __future__ import annotations

import asyncio
import contextvars
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from distributed.protocol.serialize import Serialize, to_serialize
from distributed.worker import _worker_cvar

from dask_gpu.errors import RunFailedOnWorker
from dask_gpu.tickets import Ticket, TicketRejected
from dask_gpu.worker import life as steps
from dask_gpu.worker.records import Body, BodyInfo, Outcome

__all__ = ["Body", "BodyInfo", "Handover", "Outcome", "RUN_OP", "run_ticketed"]

RUN_OP = "gpu_run"
# A run's thread only waits for its body's process (as a Dask task's seceded thread does): as many as run here.
_MAX_THREADS = 1024


def run_ticketed(ticket: Ticket | None, body: Body, key: str | None = None) -> Outcome:
    """Every admitted run: a Dask task's body (under its task's key), or a run handed over (under the `key` its
    caller names). No ticket, no run."""
    life = steps.redeem(ticket, body, key)  # 1
    steps.take_or_fork(life)  # 2
    steps.contain(life)  # 3
    try:
        with steps.hold_devices(life):  # 4
            steps.meet_the_gang(life)  # 5
            steps.run(life)  # 6
    finally:
        steps.keep_warm_or_end(life)  # 7
        steps.free(life)  # 8
    assert life.proc is not None and life.lease is not None
    result = life.result
    info = BodyInfo(id=life.proc.id, start=life.start, runs=life.proc.runs, idle_before=life.idle_before,
                    kept=life.kept, keep=life.ticket.keep_warm if life.kept else 0.0,
                    setup_seconds=result.pop("setup_seconds", 0.0), peak_memory_mb=result.pop("peak_memory_mb", None))
    return Outcome(run=life.lease.run(), member=body.member, body=info, **result)


class Handover:
    """The worker's `gpu_run` handler and the threads its runs wait in."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.pool = ThreadPoolExecutor(max_workers=_MAX_THREADS, thread_name_prefix="dask-gpu-run")
        self.callers: dict[str, tuple[Any, Ticket]] = {}  # key -> the connection its caller waits on, its ticket
        worker.handlers[RUN_OP] = self.run

    async def run(self, comm: Any, ticket: Any, body: Any, key: str) -> Serialize:
        """Run one admitted body under `key`; its Outcome, or what refused or stopped it (raised to the caller)."""
        ticket, body = _opened(ticket, Ticket, "ticket"), _opened(body, Body, "body")
        if not isinstance(key, str) or not ticket.run.endswith(f"/{key}") or key in self.callers:
            raise TicketRejected(f"gpu_run: key {key!r} must be the key its ticket was signed for, and not one "
                                 "running here. Fix: send the key the control plane follows the run by")
        context = contextvars.copy_context()
        context.run(_worker_cvar.set, self.worker)  # get_worker() in the run's steps, as in a Dask task's thread
        self.callers[key] = (comm, ticket)
        try:
            outcome = await asyncio.get_running_loop().run_in_executor(
                self.pool, partial(context.run, run_ticketed, ticket, body, key))
        except (OSError, EOFError) as exc:  # the run's own failure here, not the caller's connection breaking
            raise RunFailedOnWorker(f"{type(exc).__name__}: {exc}") from None
        finally:
            self.callers.pop(key, None)
        return to_serialize(outcome)

    def abandoned(self, key: str) -> str | None:
        """Why nobody waits for run `key` any more (its caller's connection closed), or None; what a Dask task's
        cancellation says when its client went away. The caller sends nothing while it waits, so the connection's
        end is all there is to see (Tornado notices a hang-up at once; a caller whose host vanished without one is
        caught by its lease, which only that caller renews)."""
        comm = self.callers[key][0] if key in self.callers else None
        return "its caller (the control plane) went away" if comm is not None and comm.closed() else None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _opened(value: Any, kind: type, name: str) -> Any:
    """The record a message carried (serialized by the sender), checked for its type before anything uses it."""
    if isinstance(value, Serialize):
        value = value.data
    if not isinstance(value, kind):
        raise TicketRejected(f"gpu_run: {name} must be a {kind.__name__}, not {type(value).__name__}. Fix: send "
                             "it with distributed's to_serialize")
    return value
