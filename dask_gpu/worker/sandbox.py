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

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from dask_gpu.tickets import Ticket
from dask_gpu.worker import life as steps
from dask_gpu.worker.execute import DeviceRun
from dask_gpu.worker.results import ResultRef


class BodyInfo(BaseModel):
    """Which body process ran a run, and how: the evidence that a model was loaded once per body."""

    model_config = ConfigDict(frozen=True)

    id: str
    start: Literal["cold", "warm"]  # a fresh process, or a warm body of the same key that ran earlier runs
    runs: int = 1  # the runs this body has run, this one included
    idle_before: float = 0.0  # a warm start: how long the body waited idle for this run
    setup_seconds: float = 0.0  # how long loading the code took in this run (a cold start's import, a class's __init__)
    kept: bool = False  # it stays warm after this run, for `keep` seconds at most
    keep: float = 0.0
    peak_memory_mb: float | None = None  # its cgroup's peak memory so far (None: no cgroup)


class Outcome(BaseModel):
    """How one body ended, and where it ran. `value` and `error` are pickled bytes nobody here opens; a large value
    stays on its worker and `result` says where (then `value` is empty)."""

    model_config = ConfigDict(frozen=True)

    ok: bool
    value: bytes = b""
    result: ResultRef | None = None
    error: bytes = b""
    error_type: str = ""
    error_message: str = ""
    error_text: str = ""
    stopped: str | None = None  # why it was stopped: "stop requested", "lease expired", ...
    run: DeviceRun
    member: int = 0  # which member of a gang this was (0 for a run on one host)
    logs: list[tuple[int, str]] = []
    reports: list[dict[str, Any]] = []
    body: BodyInfo | None = None  # which body ran it (None: it never reached one)


class Body(BaseModel):
    """What the control plane sends with a ticket: the pickled call and what its child needs to start warm."""

    model_config = ConfigDict(frozen=True)

    payload: bytes
    modules: list[str] = []
    env: dict[str, str] = {}
    member: int = 0  # gang runs: which member this is (0 .. hosts-1)
    devices: list[str] | None = None  # the device keys the cluster's queue chose for it (None: the worker chooses)
    queue_key: str | None = None  # its key in the cluster's queue: told the devices are free the moment the body ends
    warm_body: str | None = None  # the idle warm body the cluster's queue chose for it (None: a body of its own)


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
