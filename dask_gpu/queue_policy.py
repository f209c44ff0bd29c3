"""Which waiting runs start now, and where: pure scheduling policies (queue + free devices in, starts out).

No clock, no I/O, no Prefect, no Dask: the same objects are driven by the
discrete-event simulator (`aisched_prefect.simulator`, `bench/simulate.py`)
and by the scheduler plugin of the live queue (`dask_gpu.queue_plugin`). A
host is a Dask worker; a job needs `gpus` devices on one host, among the
hosts it allows (GPU type and memory rule some out).

Policies:
- `PlainDask`: a model of plain Dask, for comparison: each job goes to a host
  at submit (least queued work), each host runs its own queue last-in first-out,
  and a head that does not fit blocks the jobs behind it.
- `Fifo`: one queue for the cluster, strictly in submit order.
- `EasyBackfill`: FIFO with EASY backfill (the head gets a reservation; later
  jobs may start now if they cannot delay it).
- `FairShare`: ours: weighted fair share between tenants (decayed usage), a
  shortest-first preference inside it, aging so nothing waits forever, and
  EASY backfill around the reservation of whoever is first.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field


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


@dataclass(slots=True)
class Running:
    job: Job
    host: int
    start: float

    @property
    def expected_end(self) -> float:
        return self.start + self.job.estimate


@dataclass
class ClusterState:
    """Free GPUs per host and what runs where (what a policy may look at)."""

    free: list[int]
    running: list[Running] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return sum(self.free) + sum(r.job.gpus for r in self.running)


@dataclass(frozen=True, slots=True)
class Start:
    job: Job
    host: int


@dataclass(frozen=True, slots=True)
class Preemption:
    """A running job to stop, and the tenant whose quota it gives back."""

    run: Running
    for_tenant: str


def best_fit(free: list[int], gpus: int, exclude: int = -1, limit: int | None = None,
             allowed: frozenset[int] | None = None) -> int | None:
    """The host with the fewest free GPUs that still holds `gpus` (keeps big holes for big jobs)."""
    best, best_free = None, math.inf
    for h, f in enumerate(free):
        if allowed is not None and h not in allowed:
            continue
        room = min(f, limit) if h == exclude and limit is not None else f  # the reserved host: only its spare
        if room >= gpus and f < best_free:
            best, best_free = h, f
    return best


class Policy:
    """A scheduling policy: told of each submitted job, asked what starts now."""

    name = "policy"

    def submit(self, job: Job, state: ClusterState) -> None:
        raise NotImplementedError

    def schedule(self, now: float, state: ClusterState) -> list[Start]:
        raise NotImplementedError

    def preempt(self, now: float, state: ClusterState) -> list[Preemption]:
        """Running jobs to stop now; the driver stops them and submits them again. None by default."""
        return []

    def waiting(self) -> int:
        raise NotImplementedError


class PlainDask(Policy):
    """Plain Dask's behaviour, modelled: host chosen at submit, per-host LIFO, head-of-line blocking."""

    name = "plain-dask"

    def __init__(self, hosts: int) -> None:
        self.queues: list[list[Job]] = [[] for _ in range(hosts)]
        self.queued_work = [0.0] * hosts

    def submit(self, job: Job, state: ClusterState) -> None:
        per_host = [(self.queued_work[h] - state.free[h], h) for h in range(len(self.queues))]
        h = min(per_host)[1]  # least occupied, as Dask's worker objective would pick
        self.queues[h].append(job)
        self.queued_work[h] += job.gpus * job.estimate

    def schedule(self, now: float, state: ClusterState) -> list[Start]:
        starts = []
        for h, queue in enumerate(self.queues):
            while queue and queue[-1].gpus <= state.free[h]:  # last in, first out; the head blocks
                job = queue.pop()
                self.queued_work[h] -= job.gpus * job.estimate
                state.free[h] -= job.gpus
                starts.append(Start(job, h))
        return starts

    def waiting(self) -> int:
        return sum(len(q) for q in self.queues)


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
            h = best_fit(state.free, job.gpus, allowed=job.hosts)
            if h is None:
                break
            state.free[h] -= job.gpus
            starts.append(Start(job, h))
        self.remove([s.job for s in starts])
        return starts

    def waiting(self) -> int:
        return len(self.queue)


def reservation(job: Job, now: float, state: ClusterState,
                exclude: Iterable[int] = ()) -> tuple[float, int, int]:
    """When and where `job` can start at the earliest if nothing else starts: (time, host, GPUs spare there then).

    Hosts in `exclude` (already reserved for another job) are not considered.
    """
    best = (math.inf, -1, 0)
    ends: dict[int, list[Running]] = {}
    for r in state.running:
        ends.setdefault(r.host, []).append(r)
    for h, free in enumerate(state.free):
        if (job.hosts is not None and h not in job.hosts) or h in exclude:
            continue
        t = now
        for r in sorted(ends.get(h, []), key=lambda r: r.expected_end):
            if free >= job.gpus:
                break
            free += r.job.gpus
            t = max(now, r.expected_end)
        if free >= job.gpus and t < best[0]:
            best = (t, h, free - job.gpus)
    return best


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
        for job in order:  # start from the front while jobs fit; the first that does not is the head
            if not self.may_start(job, now, state, alloc):
                continue
            h = best_fit(state.free, job.gpus, allowed=job.hosts)
            if h is None:
                head = job
                break
            state.free[h] -= job.gpus
            alloc[job.tenant] = alloc.get(job.tenant, 0.0) + job.gpus
            starts.append(Start(job, h))
        if head is not None:
            shadow, reserved_host, spare = reservation(head, now, _with(state, starts, now))
            for looked, job in enumerate(order):
                if max(state.free) == 0 or (self.depth is not None and looked >= self.depth):
                    break
                if job.gpus > max(state.free):
                    continue
                if not self.may_start(job, now, state, alloc):
                    continue
                ends_in_time = now + job.estimate <= shadow
                h = best_fit(state.free, job.gpus, exclude=-1 if ends_in_time else reserved_host,
                             limit=None if ends_in_time else spare, allowed=job.hosts)
                if h is None:
                    continue
                if h == reserved_host and not ends_in_time:
                    spare -= job.gpus
                state.free[h] -= job.gpus
                alloc[job.tenant] = alloc.get(job.tenant, 0.0) + job.gpus
                starts.append(Start(job, h))
        self.remove([s.job for s in starts])
        return starts


def _with(state: ClusterState, starts: list[Start], now: float) -> ClusterState:
    """The state as it will be once `starts` run (their GPUs are already taken from `free`)."""
    return ClusterState(free=list(state.free), running=[*state.running, *(Running(s.job, s.host, now) for s in starts)])


def max_min_shares(capacity: float, demands: dict[str, float], weights: dict[str, float] | None = None) -> dict[str, float]:
    """Weighted water-filling: each tenant gets its demand or its weighted share of what is left, whichever is less."""
    weights = weights or {}
    shares: dict[str, float] = {}
    left = capacity
    todo = sorted(demands, key=lambda k: demands[k] / weights.get(k, 1.0))
    while todo:
        total_w = sum(weights.get(k, 1.0) for k in todo)
        tenant = todo.pop(0)
        shares[tenant] = min(demands[tenant], left * weights.get(tenant, 1.0) / total_w)
        left -= shares[tenant]
    return shares


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
        alloc: dict[str, float] = {}
        for r in state.running:
            alloc[r.job.tenant] = alloc.get(r.job.tenant, 0.0) + r.job.gpus
        victims: list[Running] = []
        out: list[Preemption] = []
        for tenant, q in self.queues.items():
            if not q:
                continue
            head = q[0][2]
            used = alloc.get(tenant, 0.0)
            if used + head.gpus > self.quota(tenant, now, capacity) or best_fit(state.free, head.gpus, allowed=head.hosts) is not None:
                continue
            best: tuple[float, list[Running]] | None = None
            for h, free in enumerate(state.free):
                if head.hosts is not None and h not in head.hosts:
                    continue
                borrowed = sorted((r for r in state.running if r.host == h and r.job.preemptible and r not in victims
                                   and alloc.get(r.job.tenant, 0.0) > self.quota(r.job.tenant, now, capacity)),
                                  key=lambda r: -r.start)
                chosen: list[Running] = []
                for r in borrowed:
                    if free >= head.gpus:
                        break
                    chosen.append(r)
                    free += r.job.gpus
                if free >= head.gpus and chosen:
                    lost = sum(r.job.gpus * (now - r.start) for r in chosen)
                    if best is None or lost < best[0]:
                        best = (lost, chosen)
            if best is not None:
                for r in best[1]:
                    victims.append(r)
                    out.append(Preemption(r, tenant))
                    alloc[r.job.tenant] -= r.job.gpus
                alloc[tenant] = used + head.gpus
        return out

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
            most = max(free)
            if most == 0:
                break
            h = None
            if job.gpus <= most and self.may_start(job, now, state, alloc, capacity) and not self._held_back(
                    job, now, free, alloc, reserved, holders):
                h = self._place(job, now, free, reserved)
                if h is not None:
                    free[h] -= job.gpus
                    alloc[job.tenant] = alloc.get(job.tenant, 0.0) + job.gpus
                    starts.append(Start(job, h))
                    continue
            looked += 1
            if looked > self.depth:
                break
            if (len(reserved) < max(self.reservations, 1) and job.tenant not in holders
                    and (not reserved or alloc.get(job.tenant, 0.0) < self.fair.get(job.tenant, 0.0))
                    and self.may_start(job, now, state, alloc, capacity)):
                shadow, host, spare = reservation(job, now, _with(state, starts, now), exclude=reserved)
                if host >= 0:
                    reserved[host] = [shadow, spare]
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

    @staticmethod
    def _place(job: Job, now: float, free: list[int], reserved: dict[int, list[float]]) -> int | None:
        """Best fit among the hosts where `job` delays no reservation (it ends before it, or fits beside it)."""
        best, best_free = None, math.inf
        end = now + job.estimate
        for h, f in enumerate(free):
            if job.hosts is not None and h not in job.hosts:
                continue
            r = reserved.get(h)
            room = f if r is None or end <= r[0] else min(f, int(r[1]))
            if room >= job.gpus and f < best_free:
                best, best_free = h, f
        if best is not None and best in reserved and now + job.estimate > reserved[best][0]:
            reserved[best][1] -= job.gpus
        return best
