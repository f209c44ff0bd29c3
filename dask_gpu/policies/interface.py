"""What a scheduling policy is given and answers, and the interface every policy implements.

No clock, no I/O, no Prefect, no Dask: the same objects are driven by the
discrete-event simulator (`dask_gpu.sim.simulator`, `bench/simulate.py`) and by
the scheduler plugin of the live queue (`dask_gpu.scheduler.queue`). A host is a
Dask worker; a job needs `gpus` devices on one host, among the hosts it
allows (GPU type and memory rule some out). A job wider than every host it
allows is a *gang*: it runs on whole hosts, all of them at once or not at all
(`Start.gang` lists them and the GPUs it holds on each).
"""

from __future__ import annotations

from dataclasses import dataclass, field

Holds = tuple[tuple[int, int], ...]  # (host, GPUs held there), one pair per host


@dataclass(frozen=True, slots=True)
class Job:
    """A run waiting to start: who pays, what it needs, when it asked, how long it says it takes."""

    id: int
    tenant: str
    gpus: int
    submit: float
    estimate: float
    priority: int = 0
    hosts: frozenset[int] | None = None  # the hosts it may run on; None: any
    preemptible: bool = False  # may be stopped (charged for what ran) and requeued to give GPUs back
    width: int = 0  # a gang over exactly this many whole hosts (0: the fewest whole hosts that hold its GPUs)
    no_limit: bool = False  # declared no time limit: never stopped for time, planned and charged pessimistically
    requeue: bool = False  # at its time limit it stops at a checkpoint and is queued again (Slurm's --requeue)
    ran: float = 0.0  # seconds it already ran before this submit (requeued at its limit: it goes on from there)


class OnHosts:
    """What a started and a running job both say of where they hold GPUs (a job, its first host, its gang)."""

    __slots__ = ()
    job: Job
    host: int
    gang: Holds

    @property
    def holds(self) -> Holds:
        return self.gang or ((self.host, self.job.gpus),)

    @property
    def hosts(self) -> tuple[int, ...]:
        return tuple(h for h, _ in self.holds)


@dataclass(frozen=True, slots=True)
class Start(OnHosts):
    """Start `job` on `host`; a gang on every host of `gang` (whole hosts; `host` is the first of them)."""

    job: Job
    host: int
    gang: Holds = ()


@dataclass(slots=True)
class Running(OnHosts):
    job: Job
    host: int
    start: float
    gang: Holds = ()

    @property
    def expected_end(self) -> float:
        return self.start + self.job.estimate


@dataclass
class ClusterState:
    """Free GPUs per host, GPUs per host, and what runs where (what a policy may look at).

    `size` defaults to what `free` and `running` add up to per host.
    """

    free: list[int]
    running: list[Running] = field(default_factory=list)
    size: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.size:
            self.size = list(self.free)
            for r in self.running:
                for h, g in r.holds:
                    self.size[h] += g

    @property
    def capacity(self) -> int:
        return sum(self.size)

    def add_host(self, gpus: int) -> int:
        """A new host with `gpus` free; returns its index."""
        self.free.append(gpus)
        self.size.append(gpus)
        return len(self.free) - 1

    def take(self, start: Start | Running) -> None:
        """Mark `start`'s GPUs busy."""
        for h, g in start.holds:
            self.free[h] -= g

    def release(self, run: Running) -> None:
        """Take `run` off the running list and give its GPUs back."""
        self.running.remove(run)
        for h, g in run.holds:
            self.free[h] += g


class Policy:
    """A scheduling policy: told of each submitted job, asked what starts now.

    `schedule` takes the GPUs of what it starts from `state.free`; the caller
    adds the runs to `state.running` and, when one ends, `state.release`s it.
    """

    name = "policy"

    def submit(self, job: Job, state: ClusterState) -> None:
        raise NotImplementedError

    def schedule(self, now: float, state: ClusterState) -> list[Start]:
        raise NotImplementedError

    def preempt(self, now: float, state: ClusterState) -> list[Preemption]:
        """Running jobs to stop now; the driver stops them and submits them again. None by default."""
        return []

    def remove(self, jobs: list[Job]) -> None:
        raise NotImplementedError

    def withdraw(self, jobs: list[Job]) -> None:
        """Waiting jobs that leave without the policy starting them (cancelled, their client gone, a fraction
        that found room on a shared device): by default, as `remove`."""
        self.remove(jobs)

    def started(self, jobs: list[Job], now: float) -> None:
        """Waiting jobs that started at `now` without `schedule` choosing them (a fraction that found room on a
        device already shared, a run that took an idle warm body of its key): they leave the queue, and a policy
        that keeps books counts them started, as if it had started them (each is then `finish`ed once). By
        default, as `remove`."""
        self.remove(jobs)

    def finish(self, jobs: list[Job], now: float | None = None) -> None:
        """Started jobs that ended (at `now`, when the caller knows) and will not be submitted again under their id:
        a policy forgets what it kept of them (a long-lived scheduler must not grow with every run), and may learn
        how long they really ran. Nothing by default."""

    def waiting(self) -> int:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Preemption:
    """A running job to stop, and the tenant whose quota it gives back."""

    run: Running
    for_tenant: str
