"""`FairShare`: the previous default policy (max-min fair share between tenants, shortest first within one, aging,
quotas, backfill; its `headroom` keeps GPUs idle for newcomers)."""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterator

from dask_gpu.policies.fifo import EasyBackfill
from dask_gpu.policies.interface import ClusterState, Job, Preemption, Start
from dask_gpu.policies.placement import fits_somewhere, max_min_shares, place, reclaim, reservation, with_starts

class FairShare(EasyBackfill):
    """Ours: fair share between tenants now, shortest-first within a tenant, aging, quotas, backfill.

    Each pass computes every tenant's max-min fair share of the cluster for
    what it has running and waiting (weighted) and serves tenants in order of
    how far below that share they are (ties: less recent use first); within a
    tenant, smaller work first, with a job's rank falling while it waits
    (`aging`), so long jobs are not starved. A tenant may run anything within
    its quota (its weight's part of the cluster among tenants active lately;
    a job wider than the quota runs when the tenant runs nothing else);
    beyond it, it borrows idle GPUs only with work that ends within
    `borrow_seconds`, so a tenant that arrives later gets its share back
    without preemption.

    Reservations: the first job that does not fit gets one (EASY), and so does
    the first job of each further tenant below its fair share, up to
    `reservations` hosts (a big job of a small tenant is not starved by the
    small jobs of the others); a later job starts only if it cannot delay any
    of them, and (`strict`) while one stands a tenant above its fair share
    starts nothing that would end after it. `headroom` GPUs are kept free for
    tenants that run nothing, so a newcomer's small job starts at once.
    End of the queue: once nothing has been submitted for `tail_quiet` seconds,
    a waiting job at least `tail` x (known work left, running and waiting, /
    capacity) long is served first, longest first (LPT, within the highest
    priority waiting), so the longest runs do not start last and stretch the
    makespan (`tail` 0: off).
    Preemptible jobs may borrow for any length of time: when a tenant's best
    waiting job fits its quota but no host, `preempt` stops preemptible runs
    of tenants above their quota to give it back (reclaim, as Kueue cohorts).
    Priority comes before all.

    Per-tenant queues are kept sorted (a job's rank within its tenant does
    not change with time: every job ages at the same rate) and the serving
    order is produced lazily, so a decision costs what it looks at, not the
    length of the queue.
    """

    name = "ours"
    depth = 500

    def __init__(self, weights: dict[str, float] | None = None, aging: float = 2 * 3600.0,
                 half_life: float = 3600.0, borrow_seconds: float | None = 2 * 3600.0, active_window: float = 3600.0,
                 reservations: int = 4, strict: bool = True, headroom: int = 1,
                 tail: float = 1.0, tail_quiet: float = 3600.0) -> None:
        super().__init__()
        self.weights = weights or {}
        self.aging, self.half_life = aging, half_life
        self.borrow_seconds, self.active_window = borrow_seconds, active_window
        self.reservations, self.strict, self.headroom = reservations, strict, headroom
        self.last_submit: dict[str, float] = {}
        self.queues: dict[str, list[tuple[tuple[int, float], int, Job]]] = {}
        self.waiting_gpus: dict[str, float] = {}
        self.count = 0
        self.usage: dict[str, float] = {}  # GPU-seconds received, decayed: breaks ties between tenants
        self.usage_at: float | None = None
        self._quota_at: tuple[float, int] | None = None
        self._quota_weights: tuple[set[str], float] = (set(), 0.0)
        self.tail, self.tail_quiet = tail, tail_quiet
        self.by_estimate: list[tuple[float, int, Job]] = []  # waiting jobs, longest first
        self.waiting_work = 0.0  # GPU-seconds waiting
        self.last_any = -math.inf  # the latest submit of anyone

    def _key(self, job: Job) -> tuple[int, float]:
        return (-job.priority, math.log10(1.0 + job.gpus * job.estimate / 60.0) + job.submit / self.aging)

    def submit(self, job: Job, state: ClusterState) -> None:
        bisect.insort(self.queues.setdefault(job.tenant, []), (self._key(job), job.id, job))
        self.waiting_gpus[job.tenant] = self.waiting_gpus.get(job.tenant, 0.0) + job.gpus
        self.last_submit[job.tenant] = max(job.submit, self.last_submit.get(job.tenant, job.submit))
        self.count += 1
        bisect.insort(self.by_estimate, (-job.estimate, job.id, job))
        self.waiting_work += job.gpus * job.estimate
        self.last_any = max(self.last_any, job.submit)

    def remove(self, jobs: list[Job]) -> None:
        for job in jobs:
            q = self.queues[job.tenant]
            i = bisect.bisect_left(q, (self._key(job), job.id))
            assert q[i][2] is job
            del q[i]
            self.waiting_gpus[job.tenant] -= job.gpus
            self.count -= 1
            i = bisect.bisect_left(self.by_estimate, (-job.estimate, job.id))
            assert self.by_estimate[i][2] is job
            del self.by_estimate[i]
            self.waiting_work -= job.gpus * job.estimate

    def waiting(self) -> int:
        return self.count

    def quota(self, tenant: str, now: float, capacity: int) -> float:
        """A tenant's nominal share: its weight's part of the cluster among tenants active lately."""
        if self._quota_at != (now, len(self.last_submit)):
            active = {t for t, at in self.last_submit.items() if now - at <= self.active_window}
            self._quota_weights = (active, sum(self.weights.get(t, 1.0) for t in active))
            self._quota_at = (now, len(self.last_submit))
        active, total = self._quota_weights
        w = self.weights.get(tenant, 1.0)
        return capacity * w / (total if tenant in active else total + w)

    def may_start(self, job: Job, now: float, state: ClusterState, alloc: dict[str, float],
                  capacity: int | None = None) -> bool:
        """Within its quota a tenant runs anything; beyond it (borrowing idle GPUs) only work that ends soon,
        or work that may be preempted when the owner of the quota wants it back."""
        used = alloc.get(job.tenant, 0.0)
        if self.borrow_seconds is None or used == 0 or job.preemptible or used + job.gpus <= self.quota(
                job.tenant, now, state.capacity if capacity is None else capacity):
            return True
        return job.estimate <= self.borrow_seconds

    def preempt(self, now: float, state: ClusterState) -> list[Preemption]:
        """Reclaim (as Kueue's cohorts do): a tenant whose best waiting job fits within its quota but on no
        host gets GPUs back from preemptible jobs of tenants above their quota (borrowers), on the host
        where that loses the least work (most recently started first)."""
        if not any(r.job.preemptible for r in state.running):
            return []
        capacity = state.capacity
        return reclaim(self.queues, lambda t: self.quota(t, now, capacity), now, state)

    def _charge(self, now: float, state: ClusterState) -> None:
        dt = 0.0 if self.usage_at is None else max(now - self.usage_at, 0.0)
        if dt:
            decay = 0.5 ** (dt / self.half_life)
            for t in self.usage:
                self.usage[t] *= decay
            for r in state.running:
                self.usage[r.job.tenant] = self.usage.get(r.job.tenant, 0.0) + r.job.gpus * dt
        self.usage_at = now

    def order(self, now: float, state: ClusterState | None = None) -> Iterator[Job]:
        """Jobs in the order they would be served, tenant by tenant as shares fill; produced lazily."""
        alloc: dict[str, float] = {}
        for r in (state.running if state else []):
            alloc[r.job.tenant] = alloc.get(r.job.tenant, 0.0) + r.job.gpus
        live = {t: q for t, q in self.queues.items() if q}
        demand = {t: alloc.get(t, 0.0) + self.waiting_gpus[t] for t in live}
        capacity = state.capacity if state else sum(demand.values()) or 1.0
        self.fair = fair = max_min_shares(capacity, demand, self.weights)
        first: set[int] = set()
        if self.tail and state is not None and now - self.last_any >= self.tail_quiet:
            left = self.waiting_work + sum(r.job.gpus * max(r.expected_end - now, 0.0) for r in state.running)
            horizon = self.tail * left / state.capacity
            top = max((-q[0][0][0] for q in live.values()), default=0)  # priority still comes before all
            for neg, jid, job in self.by_estimate:  # the critical jobs, longest first; lazily
                if -neg < horizon:
                    break
                if job.priority < top:
                    continue
                first.add(jid)
                alloc[job.tenant] = alloc.get(job.tenant, 0.0) + job.gpus
                yield job

        def entry(t: str, i: int) -> tuple:
            key, jid, _ = live[t][i]
            return (key[0], alloc.get(t, 0.0) / max(fair.get(t, 0.0), 1e-9),
                    self.usage.get(t, 0.0) / self.weights.get(t, 1.0), key[1], jid, t, i)

        heap = [entry(t, 0) for t in live]
        heapq.heapify(heap)
        while heap:
            *_, t, i = heapq.heappop(heap)
            job = live[t][i][2]
            if job.id not in first:  # a critical job is counted (and served) already
                alloc[t] = alloc.get(t, 0.0) + job.gpus
            if i + 1 < len(live[t]):
                heapq.heappush(heap, entry(t, i + 1))
            if job.id not in first:
                yield job

    def schedule(self, now: float, state: ClusterState) -> list[Start]:
        self._charge(now, state)
        free = state.free
        alloc: dict[str, float] = {}
        for r in state.running:
            alloc[r.job.tenant] = alloc.get(r.job.tenant, 0.0) + r.job.gpus
        starts: list[Start] = []
        reserved: dict[int, list[float]] = {}  # host -> [reserved from, GPUs spare there then]
        holders: set[str] = set()
        looked = 0
        capacity = state.capacity
        for job in self.order(now, state):
            if max(free) == 0:
                break
            if fits_somewhere(job, state) and self.may_start(job, now, state, alloc, capacity) and not self._held_back(
                    job, now, free, alloc, reserved, holders):
                start = place(job, now, state, reserved)
                if start is not None:
                    state.take(start)
                    alloc[job.tenant] = alloc.get(job.tenant, 0.0) + job.gpus
                    starts.append(start)
                    continue
            looked += 1
            if looked > self.depth:
                break
            if (len(reserved) < max(self.reservations, 1) and job.tenant not in holders
                    and (not reserved or alloc.get(job.tenant, 0.0) < self.fair.get(job.tenant, 0.0))
                    and self.may_start(job, now, state, alloc, capacity)):
                at, spare = reservation(job, now, with_starts(state, starts, now), exclude=reserved)
                if spare:
                    reserved.update({h: [at, s] for h, s in spare.items()})
                    holders.add(job.tenant)
        self.remove([s.job for s in starts])
        return starts

    def _held_back(self, job: Job, now: float, free: list[int], alloc: dict[str, float],
                   reserved: dict[int, list[float]], holders: set[str]) -> bool:
        """Whether `job` waits though it fits: it would take the last `headroom` free GPUs and its tenant runs
        something already (they are kept for a tenant that runs nothing), or (`strict`) it would take its tenant
        past its fair share while a tenant below its share waits on a reservation, and end after that."""
        used = alloc.get(job.tenant, 0.0)
        if self.headroom and used and sum(free) - job.gpus < self.headroom:
            return True
        return bool(self.strict and reserved and job.tenant not in holders
                    and used + job.gpus > self.fair.get(job.tenant, 0.0)
                    and now + job.estimate > min(r[0] for r in reserved.values()))
