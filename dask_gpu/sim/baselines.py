"""The simulator's baselines beside ours: a model of plain Dask, SJF with EASY, Tiresias' 2D-LAS, max-min fair share.

For comparison only (`bench/simulate.py`, `bench/days.py`): the live queue never runs them.
- `PlainDask`: a model of plain Dask: each job goes to a host at submit (least occupancy: queued plus remaining
  running GPU-seconds per GPU), each host runs its own queue first in first out (Dask's priorities: older submits
  first), and a head that does not fit blocks the jobs behind it.
- `SjfEasy`, `Las2D`, `MaxMinFair`: with EASY's reservation and backfill: smallest estimated work first; Tiresias'
  2D-LAS (least attained GPU-time, discretised queues, no duration needed); max-min fair share between tenants
  (Gavel/DRF-like).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator

from dask_gpu.policies.fifo import EasyBackfill
from dask_gpu.policies.interface import ClusterState, Holds, Job, Policy, Start
from dask_gpu.policies.placement import is_gang, member_gpus

class PlainDask(Policy):
    """Plain Dask's behaviour, modelled: host chosen at submit, per-host FIFO, head-of-line blocking.

    The host is the one with the least occupancy (GPU-seconds queued there plus
    those left of its running jobs, per GPU; ties: lowest index), as Dask's
    `worker_objective` picks the worker where a task starts soonest. Each
    worker runs its constrained tasks in priority order (older submits first)
    and waits while the first does not fit (`WorkerState._next_ready_task`).
    A gang goes to the least occupied whole hosts and starts once it is first
    in all their queues and they are idle. Work stealing is not modelled.
    """

    name = "plain-dask"

    def __init__(self, hosts: int = 0) -> None:
        self.queues: list[list[Job]] = [[] for _ in range(hosts)]
        self.heads = [0] * hosts  # index of each queue's first job (popping from the front is O(1) this way)
        self.queued_work = [0.0] * hosts
        self.gangs: dict[int, Holds] = {}  # job id -> the whole hosts chosen for it at submit

    def _grow(self, hosts: int) -> None:
        while len(self.queues) < hosts:
            self.queues.append([])
            self.heads.append(0)
            self.queued_work.append(0.0)

    def occupancy(self, state: ClusterState, now: float) -> list[float]:
        """GPU-seconds queued and left to run per host, per GPU of the host."""
        self._grow(len(state.free))
        left = list(self.queued_work)
        for r in state.running:
            for h, g in r.holds:
                left[h] += g * max(r.expected_end - now, 0.0)
        return [left[h] / max(state.size[h], 1) for h in range(len(state.free))]

    def submit(self, job: Job, state: ClusterState) -> None:
        occ = self.occupancy(state, job.submit)
        allowed = [h for h in range(len(state.free)) if job.hosts is None or h in job.hosts]
        if is_gang(job, state.size):
            chosen, got = [], 0
            for h in sorted(allowed, key=lambda h: (occ[h], h)):
                if (got >= job.gpus and not job.width) or len(chosen) == job.width > 0:
                    break
                if state.size[h] < member_gpus(job):
                    continue
                chosen.append((h, state.size[h]))
                got += state.size[h]
            self.gangs[job.id] = tuple(chosen)
            for h, g in chosen:
                self.queues[h].append(job)
                self.queued_work[h] += g * job.estimate
            return
        h = min((h for h in allowed if state.size[h] >= job.gpus), key=lambda h: (occ[h], h))
        self.queues[h].append(job)
        self.queued_work[h] += job.gpus * job.estimate

    def _pop(self, h: int) -> None:
        self.heads[h] += 1
        if self.heads[h] > 64 and self.heads[h] * 2 > len(self.queues[h]):
            del self.queues[h][: self.heads[h]]
            self.heads[h] = 0

    def _head(self, h: int) -> Job | None:
        q = self.queues[h]
        return q[self.heads[h]] if self.heads[h] < len(q) else None

    def schedule(self, now: float, state: ClusterState) -> list[Start]:
        self._grow(len(state.free))
        starts = []
        for h in range(len(self.queues)):
            while (job := self._head(h)) is not None:
                gang = self.gangs.get(job.id)
                if gang is None:
                    if job.gpus > state.free[h]:
                        break  # the head blocks the rest of this worker's queue
                    self._pop(h)
                    self.queued_work[h] -= job.gpus * job.estimate
                    start = Start(job, h)
                elif all(self._head(x) is job and state.free[x] == state.size[x] for x, _ in gang):
                    for x, g in gang:
                        self._pop(x)
                        self.queued_work[x] -= g * job.estimate
                    del self.gangs[job.id]
                    start = Start(job, gang[0][0], gang)
                else:
                    break
                state.take(start)
                starts.append(start)
        return starts

    def waiting(self) -> int:
        return sum(len(q) - i for q, i in zip(self.queues, self.heads)) - sum(len(g) - 1 for g in self.gangs.values())


class SjfEasy(EasyBackfill):
    """Shortest job first with EASY backfill (a baseline): smallest estimated work (GPUs x estimate) first, ties in
    submit order; the first that does not fit reserves, later ones backfill around it. It plans with the same
    estimates as every other policy, so with users' estimates it is only as good as they are."""

    name = "sjf-easy"

    def submit(self, job: Job, state: ClusterState) -> None:
        bisect.insort(self.queue, job, key=self._key)

    @staticmethod
    def _key(job: Job) -> tuple[int, float, float, int]:
        return (-job.priority, job.gpus * job.estimate, job.submit, job.id)

    def remove(self, jobs: list[Job]) -> None:
        for job in jobs:
            i = bisect.bisect_left(self.queue, self._key(job), key=self._key)
            assert self.queue[i] is job
            del self.queue[i]


class _PerTenant(EasyBackfill):
    """A baseline that serves tenants' queues (each in submit order) in an order of tenants it computes each pass,
    with EASY's reservation and backfill. Subclasses give `rank(now, state)` and may `charge` per pick."""

    def __init__(self, weights: dict[str, float] | None = None) -> None:
        super().__init__()
        self.weights = weights or {}
        self.queues: dict[str, list[Job]] = {}  # per tenant: priority first, then submit order
        self.count = 0

    @staticmethod
    def _key(job: Job) -> tuple[int, float, int]:
        return (-job.priority, job.submit, job.id)

    def submit(self, job: Job, state: ClusterState) -> None:
        bisect.insort(self.queues.setdefault(job.tenant, []), job, key=self._key)  # at the end but for a requeue
        self.count += 1

    def remove(self, jobs: list[Job]) -> None:
        for job in jobs:
            q = self.queues[job.tenant]
            i = bisect.bisect_left(q, self._key(job), key=self._key)
            assert q[i] is job
            del q[i]
        self.count -= len(jobs)

    def waiting(self) -> int:
        return self.count

    def rank(self, now: float, state: ClusterState) -> dict[str, float]:
        raise NotImplementedError

    def charge(self, rank: dict[str, float], job: Job) -> None:
        """A pick of `job` changes its tenant's rank in this pass (nothing by default)."""

    def order(self, now: float, state: ClusterState | None = None) -> Iterator[Job]:
        assert state is not None
        live = {t: q for t, q in self.queues.items() if q}
        rank = self.rank(now, state)
        heap = [(-q[0].priority, rank.get(t, 0.0), q[0].submit, q[0].id, t, 0) for t, q in live.items()]
        heapq.heapify(heap)
        while heap:
            *_, t, i = heapq.heappop(heap)
            job = live[t][i]
            self.charge(rank, job)
            if i + 1 < len(live[t]):
                nxt = live[t][i + 1]
                heapq.heappush(heap, (-nxt.priority, rank.get(t, 0.0), nxt.submit, nxt.id, t, i + 1))
            yield job


class Las2D(_PerTenant):
    """Tiresias-style 2D-LAS (a baseline), needing no duration: discretised priority queues on attained service in
    GPU-seconds (GPUs x time run). Queue k holds tenants that have received between `thresholds[k-1]` and
    `thresholds[k]` GPU-hours; lower queues first, each in submit order (Tiresias' 2D-LAS with its discretisation
    and FIFO within a queue). The trace's jobs are not preemptible, so a job's own attained service is 0 while it
    waits; the service counted is its tenant's (each pass from what runs and ran), which makes the rule a
    fairness one across tenants. EASY's head reservation keeps wide jobs from starving.
    """

    name = "las-2d"

    def __init__(self, weights: dict[str, float] | None = None,
                 thresholds: tuple[float, ...] = (1.0, 10.0, 100.0, 1000.0)) -> None:
        super().__init__(weights)
        self.thresholds = [t * 3600.0 for t in thresholds]
        self.attained: dict[str, float] = {}
        self.at: float | None = None
        self.alloc: dict[str, int] = {}  # GPUs each tenant held after the last pass (held until this one)

    def rank(self, now: float, state: ClusterState) -> dict[str, float]:
        dt = 0.0 if self.at is None else max(now - self.at, 0.0)
        self.at = now
        for t, g in self.alloc.items():  # a run that ended since ran until this pass (an end triggers one)
            self.attained[t] = self.attained.get(t, 0.0) + g * dt
        return {t: float(bisect.bisect_right(self.thresholds, self.attained.get(t, 0.0) / self.weights.get(t, 1.0)))
                for t in self.queues}

    def schedule(self, now: float, state: ClusterState) -> list[Start]:
        starts = super().schedule(now, state)
        self.alloc = {}
        for r in [*state.running, *starts]:
            self.alloc[r.job.tenant] = self.alloc.get(r.job.tenant, 0) + r.job.gpus
        return starts


class MaxMinFair(_PerTenant):
    """Max-min fair share (a baseline; Gavel's max-min fairness / DRF with one resource): each pick goes to the
    tenant with the fewest GPUs per unit of weight (running, plus what this pass already picked), its oldest job
    first; EASY's reservation for the first that does not fit, backfill around it."""

    name = "max-min"

    def rank(self, now: float, state: ClusterState) -> dict[str, float]:
        alloc: dict[str, float] = {}
        for r in state.running:
            alloc[r.job.tenant] = alloc.get(r.job.tenant, 0.0) + r.job.gpus
        return {t: alloc.get(t, 0.0) / self.weights.get(t, 1.0) for t in self.queues}

    def charge(self, rank: dict[str, float], job: Job) -> None:
        rank[job.tenant] = rank.get(job.tenant, 0.0) + job.gpus / self.weights.get(job.tenant, 1.0)
