"""The one Dask task function of admitted work: `run_ticketed`, a body's life on this worker as one pass.

`run_ticketed` is what the control plane submits, with a ticket and the `Body` it was signed for. It calls the
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
"""

from __future__ import annotations

from dask_gpu.tickets import Ticket
from dask_gpu.worker import life as steps
from dask_gpu.worker.records import Body, BodyInfo, Outcome

__all__ = ["Body", "BodyInfo", "Outcome", "run_ticketed"]


def run_ticketed(ticket: Ticket | None, body: Body) -> Outcome:
    """Dask task body of every admitted run. No ticket, no run."""
    life = steps.redeem(ticket, body)  # 1
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
