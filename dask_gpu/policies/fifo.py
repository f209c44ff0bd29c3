"""One queue in submit order: `Fifo`, and `EasyBackfill` (FIFO whose head reserves the earliest room and whose
later jobs start only where they cannot delay it), the base of every policy with a reservation."""

from __future__ import annotations

from collections.abc import Iterable

from dask_gpu.policies.interface import ClusterState, Job, Policy, Start
from dask_gpu.policies.placement import fits_somewhere, place, reservation, with_starts

class Fifo(Policy):
    """One queue in submit order; the head waits for room and everyone waits behind it."""

    name = "fifo"

    def __init__(self) -> None:
        self.queue: list[Job] = []

    def submit(self, job: Job, state: ClusterState) -> None:
        self.queue.append(job)

    def order(self, now: float, state: ClusterState | None = None) -> Iterable[Job]:
        """The jobs in the order they are served."""
        return self.queue

    def remove(self, jobs: list[Job]) -> None:
        started = {id(j) for j in jobs}
        self.queue = [j for j in self.queue if id(j) not in started]

    def schedule(self, now: float, state: ClusterState) -> list[Start]:
        starts = []
        for job in self.order(now, state):
            start = place(job, now, state, {})
            if start is None:
                break
            state.take(start)
            starts.append(start)
        self.remove([s.job for s in starts])
        return starts

    def waiting(self) -> int:
        return len(self.queue)


class EasyBackfill(Fifo):
    """FIFO with EASY backfill: a job behind the head starts now only if it cannot delay the head's reservation.

    `depth` bounds how many jobs behind the head one pass looks at (Slurm's
    bf_max_job_test), so a decision stays fast with a long queue.
    """

    name = "easy-backfill"
    depth: int | None = None

    def may_start(self, job: Job, now: float, state: ClusterState, alloc: dict[str, float]) -> bool:
        """Whether `job` may start now at all (quotas); FIFO and EASY have none."""
        return True

    def schedule(self, now: float, state: ClusterState) -> list[Start]:
        starts: list[Start] = []
        alloc: dict[str, float] = {}
        for r in state.running:
            alloc[r.job.tenant] = alloc.get(r.job.tenant, 0.0) + r.job.gpus
        order = iter(self.order(now, state))
        head: Job | None = None
        for job in order:  # 2. start from the front while jobs fit; the first that does not is the head
            if not self.may_start(job, now, state, alloc):
                continue
            start = place(job, now, state, {})
            if start is None:
                head = job
                break
            state.take(start)
            alloc[job.tenant] = alloc.get(job.tenant, 0.0) + job.gpus
            starts.append(start)
        if head is not None:  # 3. the head's reservation; 4. backfill around it
            at, spare = reservation(head, now, with_starts(state, starts, now))
            reserved = {h: [at, s] for h, s in spare.items()}
            for looked, job in enumerate(order):
                if max(state.free) == 0 or (self.depth is not None and looked >= self.depth):
                    break
                if not fits_somewhere(job, state) or not self.may_start(job, now, state, alloc):
                    continue
                start = place(job, now, state, reserved)
                if start is None:
                    continue
                state.take(start)
                alloc[job.tenant] = alloc.get(job.tenant, 0.0) + job.gpus
                starts.append(start)
        self.remove([s.job for s in starts])
        return starts
