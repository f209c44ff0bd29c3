"""Which waiting runs start now, and where: pure scheduling policies (queue + free devices in, starts out).

No clock, no I/O, no Prefect, no Dask: the same objects are driven by the
discrete-event simulator (`dask_gpu.simulator`, `bench/simulate.py`) and by
the scheduler plugin of the live queue (`dask_gpu.queue_plugin`). A host is a
Dask worker; a job needs `gpus` devices on one host, among the hosts it
allows (GPU type and memory rule some out). A job wider than every host it
allows is a *gang*: it runs on whole hosts, all of them at once or not at all
(`Start.gang` lists them and the GPUs it holds on each).

Phases of one decision (every policy): 1. order the waiting jobs; 2. start
from the front while jobs fit; 3. reserve room for the first that does not
(EASY), and 4. backfill later jobs that cannot delay a reservation.

Policies:
- `PlainDask`: a model of plain Dask, for comparison: each job goes to a host
  at submit (least occupancy: queued plus remaining running GPU-seconds per
  GPU), each host runs its own queue first in first out (Dask's priorities:
  older submits first), and a head that does not fit blocks the jobs behind it.
- `Fifo`: one queue for the cluster, strictly in submit order.
- `EasyBackfill`: FIFO with EASY backfill (the head gets a reservation; later
  jobs may start now if they cannot delay it).
- `SjfEasy`, `Las2D`, `MaxMinFair`: baselines for the simulator with EASY's
  reservation and backfill: smallest estimated work first; Tiresias' 2D-LAS
  (least attained GPU-time, discretised queues, no duration needed); max-min
  fair share between tenants (Gavel/DRF-like).
- `FinishTimeFair`: ours (see its docstring), the live queue's default: shortest
  first, with jobs about to finish much later than they would alone on their
  tenant's share served first; no GPU held idle beyond EASY's reservations.
- `FairShare`: the previous policy (max-min fair share between tenants; its
  `headroom` keeps GPUs idle for newcomers).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

Holds = tuple[tuple[int, int], ...]  # (host, GPUs held there), one pair per host

LIVE_HALF_LIFE = 7 * 24 * 3600.0  # the live queue's fairness memory halves weekly (Slurm's PriorityDecayHalfLife)


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


@dataclass(frozen=True, slots=True)
class Start:
    """Start `job` on `host`; a gang on every host of `gang` (whole hosts; `host` is the first of them)."""

    job: Job
    host: int
    gang: Holds = ()

    @property
    def holds(self) -> Holds:
        return self.gang or ((self.host, self.job.gpus),)

    @property
    def hosts(self) -> tuple[int, ...]:
        return tuple(h for h, _ in self.holds)


@dataclass(slots=True)
class Running:
    job: Job
    host: int
    start: float
    gang: Holds = ()

    @property
    def expected_end(self) -> float:
        return self.start + self.job.estimate

    @property
    def holds(self) -> Holds:
        return self.gang or ((self.host, self.job.gpus),)

    @property
    def hosts(self) -> tuple[int, ...]:
        return tuple(h for h, _ in self.holds)


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


def is_gang(job: Job, size: list[int]) -> bool:
    """Whether `job` is wider than every host it may use (so it needs several whole hosts).

    >>> is_gang(Job(0, "a", 16, 0.0, 1.0), [8, 8]), is_gang(Job(0, "a", 8, 0.0, 1.0), [8, 8])
    (True, False)
    """
    return job.width > 1 or job.gpus > max((s for h, s in enumerate(size) if job.hosts is None or h in job.hosts),
                                           default=0)


def member_gpus(job: Job) -> int:
    """GPUs each host of a gang of fixed `width` must have (0 when the width is not fixed).

    >>> member_gpus(Job(0, "a", 16, 0.0, 1.0, width=2)), member_gpus(Job(0, "a", 16, 0.0, 1.0))
    (8, 0)
    """
    return -(-job.gpus // job.width) if job.width else 0


def gang_fit(job: Job, free: list[int], size: list[int], usable: Iterable[int] | None = None) -> Holds | None:
    """Whole idle hosts for a gang, fewest first (largest hosts, then lowest index), or None if too few are idle.

    >>> gang_fit(Job(0, "a", 12, 0.0, 1.0), [8, 3, 8, 8], [8, 8, 8, 8])
    ((0, 8), (2, 8))
    >>> gang_fit(Job(0, "a", 32, 0.0, 1.0), [8, 3, 8, 8], [8, 8, 8, 8]) is None
    True
    """
    idle = [h for h in (range(len(free)) if usable is None else usable)
            if free[h] == size[h] > 0 and (job.hosts is None or h in job.hosts)]
    if job.width:  # exactly `width` hosts, each with at least its share: the smallest that do, to keep big ones
        need = member_gpus(job)
        fit = sorted((h for h in idle if size[h] >= need), key=lambda h: (size[h], h))[: job.width]
        return tuple((h, size[h]) for h in fit) if len(fit) == job.width else None
    idle.sort(key=lambda h: (-size[h], h))
    chosen, got = [], 0
    for h in idle:
        if got >= job.gpus:
            break
        chosen.append((h, size[h]))
        got += size[h]
    return tuple(chosen) if got >= job.gpus else None


def best_fit(free: list[int], gpus: int, exclude: int = -1, limit: int | None = None,
             allowed: frozenset[int] | None = None) -> int | None:
    """The host with the fewest free GPUs that still holds `gpus` (keeps big holes for big jobs).

    >>> best_fit([4, 2, 3], 2), best_fit([4, 2, 3], 3), best_fit([4, 2, 3], 5)
    (1, 2, None)
    """
    best, best_free = None, math.inf
    for h, f in enumerate(free):
        if allowed is not None and h not in allowed:
            continue
        room = min(f, limit) if h == exclude and limit is not None else f  # the reserved host: only its spare
        if room >= gpus and f < best_free:
            best, best_free = h, f
    return best


def fits_somewhere(job: Job, state: ClusterState) -> bool:
    """A quick test: could `job` start on the free GPUs at all (ignoring reservations)?"""
    if is_gang(job, state.size):
        return gang_fit(job, state.free, state.size) is not None
    return any(f >= job.gpus for h, f in enumerate(state.free) if job.hosts is None or h in job.hosts)


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


Reserved = dict[int, list[float]]  # host -> [reserved from, GPUs spare there then]


def place(job: Job, now: float, state: ClusterState, reserved: Reserved,
          drain: list[float] | None = None) -> Start | None:
    """Where `job` starts now without delaying any reservation (it ends before it, or fits beside it):
    the best fit among hosts, whole idle hosts for a gang; None if nowhere. Uses up the spare it takes.

    With `drain` (when each host's running jobs are expected to be done), the host whose drain time the
    job pushes out least comes first (then best fit): long jobs go beside long jobs, so the other hosts
    empty soon for wide jobs.
    """
    end = now + job.estimate
    if is_gang(job, state.size):
        usable = [h for h in range(len(state.free)) if h not in reserved or end <= reserved[h][0]]
        holds = gang_fit(job, state.free, state.size, usable)
        return Start(job, holds[0][0], holds) if holds else None
    best, best_key = None, (math.inf, math.inf)
    for h, f in enumerate(state.free):
        if job.hosts is not None and h not in job.hosts:
            continue
        r = reserved.get(h)
        room = f if r is None or end <= r[0] else min(f, int(r[1]))
        if room >= job.gpus:
            key = (max(end - drain[h], 0.0) if drain is not None else 0.0, f)
            if key < best_key:
                best, best_key = h, key
    if best is None:
        return None
    if best in reserved and end > reserved[best][0]:
        reserved[best][1] -= job.gpus
    return Start(job, best)


def drain_times(now: float, state: ClusterState) -> list[float]:
    """When each host's running jobs are expected to be done (now for an idle host)."""
    out = [now] * len(state.free)
    for r in state.running:
        for h, _ in r.holds:
            out[h] = max(out[h], r.expected_end)
    return out


def reservation(job: Job, now: float, state: ClusterState, exclude: Iterable[int] = ()) -> tuple[float, dict[int, int]]:
    """When and where `job` can start at the earliest if nothing else starts: (time, {host: GPUs spare there then}).

    A gang reserves whole hosts (none spare). Hosts in `exclude` (reserved for another job) are not
    considered; (inf, {}) if no host ever can.
    """
    exclude = set(exclude)
    ends: dict[int, list[tuple[float, int]]] = {}
    for r in state.running:
        for h, g in r.holds:
            ends.setdefault(h, []).append((max(now, r.expected_end), g))
    hosts = [h for h in range(len(state.free)) if h not in exclude and (job.hosts is None or h in job.hosts)]
    if is_gang(job, state.size):
        idle_at = sorted((max((t for t, _ in ends.get(h, [])), default=now), -state.size[h], h)
                         for h in hosts if state.size[h] > 0 and state.size[h] >= member_gpus(job))
        if job.width:
            return (idle_at[job.width - 1][0], {h: 0 for _, _, h in idle_at[: job.width]}) \
                if len(idle_at) >= job.width else (math.inf, {})
        got, chosen = 0, {}
        for t, neg, h in idle_at:
            chosen[h] = 0
            got -= neg
            if got >= job.gpus:
                return t, chosen
        return math.inf, {}
    best: tuple[float, dict[int, int]] = (math.inf, {})
    for h in hosts:
        free, t = state.free[h], now
        for end, g in sorted(ends.get(h, [])):
            if free >= job.gpus:
                break
            free += g
            t = end
        if free >= job.gpus and t < best[0]:
            best = (t, {h: free - job.gpus})
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
            at, spare = reservation(head, now, _with(state, starts, now))
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


def _with(state: ClusterState, starts: list[Start], now: float) -> ClusterState:
    """The state as it will be once `starts` run (their GPUs are already taken from `free`)."""
    return ClusterState(free=list(state.free), size=state.size,
                        running=[*state.running, *(Running(s.job, s.host, now, s.gang) for s in starts)])


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


def reclaim(queues: dict[str, list[tuple[tuple[int, float], int, Job]]], quota: Callable[[str], float], now: float,
            state: ClusterState) -> list[Preemption]:
    """Preemptions that give tenants their quota back (Kueue's reclaim within a cohort).

    `queues`: each tenant's waiting jobs, sorted, its best first. A tenant whose best waiting job fits within its
    `quota(tenant)` beside what it runs, but on no host now, gets GPUs back from preemptible runs of tenants above
    their quota (borrowers), on the host where that loses the least work (the most recently started runs first).
    A gang reclaims nothing (it waits for whole hosts), and a gang's members are never stopped.
    """
    alloc: dict[str, float] = {}
    for r in state.running:
        alloc[r.job.tenant] = alloc.get(r.job.tenant, 0.0) + r.job.gpus
    victims: list[Running] = []
    out: list[Preemption] = []
    for tenant, q in queues.items():
        if not q:
            continue
        head = q[0][2]
        used = alloc.get(tenant, 0.0)
        if (is_gang(head, state.size) or used + head.gpus > quota(tenant)
                or best_fit(state.free, head.gpus, allowed=head.hosts) is not None):
            continue
        best: tuple[float, list[Running]] | None = None
        for h, free in enumerate(state.free):
            if head.hosts is not None and h not in head.hosts:
                continue
            borrowed = sorted((r for r in state.running if r.host == h and not r.gang and r.job.preemptible
                               and r not in victims and alloc.get(r.job.tenant, 0.0) > quota(r.job.tenant)),
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
                at, spare = reservation(job, now, _with(state, starts, now), exclude=reserved)
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


class FinishTimeFair(EasyBackfill):
    """Ours: shortest first, except for tenants whose jobs are finishing later than they would alone.

    Finish-time fairness (Themis) online: each job gets, at submit, an *alone*
    completion time: how long it would take if its tenant had a private pool
    of the cluster's GPUs x its weight's part (among tenants that submitted
    within `horizon`; at least its widest job so far) and ran its jobs there in
    submit order (a backlog clock per tenant: the pool is busy until the work
    before the job, / the pool's GPUs, is done). A tenant's rho now is the
    sum of its jobs' completion times so far (started: start - submit +
    estimate; waiting: now - submit + estimate) over the sum of their alone
    times. A tenant whose rho is above `behind` is *behind*. With `learn`, a
    run's terms are corrected to its real run time when it ends (`finish`).

    1. Order: priority first; then smallest work (GPUs x estimate) first,
       whoever sends it, where a behind tenant's work counts (behind / its
       rho) ** `sharpness` of itself: its small jobs jump ahead, its big ones
       do not pass everyone's small ones (fairness over work, not over jobs).
       `sharpness` 0: the tenants behind first, furthest behind first, each
       shortest first; then everyone else's (the previous order). End of the queue: once nothing
       was submitted for `tail_quiet` seconds, a waiting job at least `tail`
       x (known work left / capacity) long goes first, longest first (LPT),
       so the longest runs do not start last.
    2. Start from the front while jobs fit (gangs on whole hosts; with
       `align`, on the host whose drain time the job pushes out least, then
       best fit, so wide jobs find empty hosts sooner).
    3. The first job that does not fit reserves the earliest room (EASY), and
       so does the first that does not fit of each tenant behind, up to
       `reservations` jobs.
    4. Later jobs start only where they delay no reservation; at most `depth`
       jobs that do not start are looked at (Slurm's bf_max_job_test).

    Preemption (Kueue's reclaim, as `FairShare`): a run declared preemptible
    may borrow idle GPUs for any length of time; when a tenant's best waiting
    job fits within its quota (its weight's part of the cluster among the
    tenants that run or wait now) but on no host, `preempt` stops preemptible
    runs of tenants above their quota on the host where that loses the least
    work, and the claimant is served first in the same pass.

    Fairness memory may fade: with `half_life`, what a tenant's jobs took and
    would have taken alone counts with a weight halving every `half_life`
    seconds, so a tenant's rho speaks of its recent weeks, not of everything
    since the scheduler started. The live queue fades with a 7-day half-life
    (`LIVE_HALF_LIFE`, as Slurm's PriorityDecayHalfLife); the simulator's
    one-day slices run without (None, the default).

    No GPU is held back beyond the reservations. A heavy tenant's alone times
    are long (its private pool would be swamped), so it is rarely behind and
    its jobs go shortest first; a light tenant falls behind as soon as its
    jobs wait. Per-tenant queues stay sorted and are merged lazily by a heap
    over tenants, so a decision costs what it looks at, not the queue's length.
    """

    name = "ours"
    depth = 500

    def __init__(self, weights: dict[str, float] | None = None, behind: float = 0.7, overdue: float = 1.5,
                 horizon: float = 6 * 3600.0, reservations: int = 4, tail: float = 1.0, tail_quiet: float = 3600.0,
                 align: bool = True, owed: bool = False, half_life: float | None = None, learn: bool = True,
                 sharpness: float = 4.0) -> None:
        super().__init__()
        if half_life is not None and not half_life > 0:
            raise ValueError(f"half_life must be positive seconds or None (never fade), not {half_life!r}")
        self.owed = owed
        self.half_life = half_life
        self.epoch: float | None = None  # `done` and `alone_sum` are stored x 2**((t - epoch) / half_life)
        self.weights = weights or {}
        self.behind, self.overdue, self.horizon, self.reservations = behind, overdue, horizon, reservations
        self.due: list[tuple[float, int, Job]] = []  # heap: (when a job's own wait makes it overdue, id, job)
        self.late: list[tuple[tuple[int, float], int, Job]] = []  # overdue jobs: ((-priority, when), id, job)
        self.is_late: set[int] = set()
        self.tail, self.tail_quiet, self.align = tail, tail_quiet, align
        self.queues: dict[str, list[tuple[tuple[int, float], int, Job]]] = {}  # ((-priority, work), id, job)
        self.backlog: dict[str, float] = {}  # tenant -> when its private pool would be idle
        self.widest: dict[str, int] = {}  # tenant -> its widest job so far (its pool is at least that)
        self.last_submit: dict[str, float] = {}
        self.alone: dict[int, float] = {}  # job id -> its completion time alone
        self.alone_sum: dict[str, float] = {}  # tenant -> sum of its jobs' alone times (stored scaled, see `_weight`)
        self.done: dict[str, float] = {}  # tenant -> sum of (start - submit + estimate) of its started jobs (scaled)
        self.done_by: dict[int, tuple[float, float]] = {}  # job id -> (what it added to done, when): taken back if
        # it is requeued
        self.pending: dict[str, list[float]] = {}  # tenant -> [jobs waiting, sum of submit, sum of estimate]
        self.by_estimate: list[tuple[float, int, int, Job]] = []  # waiting jobs, longest then widest first
        self.count = 0
        self.waiting_work = 0.0
        self.last_any = -math.inf
        self.claims: dict[int, Job] = {}  # waiting jobs that runs were preempted for: served first
        self.learn, self.sharpness = learn, sharpness
        self.runs: dict[int, float] = {}  # running job id -> its start (to learn its real run time at `finish`)
        self.last_pool: dict[str, float] = {}  # tenant -> its private pool's GPUs at its latest submit

    # -- the queue ----------------------------------------------------------------------
    def pool(self, tenant: str, now: float, capacity: int) -> float:
        """A tenant's private pool: its weight's part of the cluster among tenants active within `horizon`."""
        w = self.weights.get(tenant, 1.0)
        total = sum(self.weights.get(t, 1.0) for t, at in self.last_submit.items()
                    if now - at <= self.horizon and t != tenant) + w
        return capacity * w / total

    def _weight(self, when: float) -> float:
        """What a value added at `when` is stored as, per unit: 2**((when - epoch) / half_life). Stored sums over
        `_weight(now)` are their faded values now; a term stays exact to take back later. The epoch moves
        forward (every stored sum rescaled) before the weights could overflow.

        >>> p = FinishTimeFair(half_life=10.0)
        >>> p.epoch = 0.0
        >>> p._weight(0.0), p._weight(10.0), p._weight(-10.0)
        (1.0, 2.0, 0.5)
        """
        if self.half_life is None:
            return 1.0
        if self.epoch is None:
            self.epoch = when
        if when - self.epoch > 512 * self.half_life:
            fade = 2.0 ** ((self.epoch - when) / self.half_life)
            for sums in (self.done, self.alone_sum):
                for t in sums:
                    sums[t] *= fade
            self.epoch = when
        return 2.0 ** ((when - self.epoch) / self.half_life)

    def submit(self, job: Job, state: ClusterState) -> None:
        now, t = job.submit, job.tenant
        self.last_submit[t] = max(now, self.last_submit.get(t, now))
        if job.id not in self.alone:
            self.widest[t] = max(self.widest.get(t, 0), job.gpus)
            gpus = max(self.pool(t, now, state.capacity), self.widest[t])
            self.last_pool[t] = gpus
            begin = max(now, self.backlog.get(t, now))
            self.backlog[t] = begin + job.gpus * job.estimate / gpus
            self.alone[job.id] = begin - now + job.estimate
            w = self._weight(now)  # first: a rebase rescales the sums it reads
            self.alone_sum[t] = self.alone_sum.get(t, 0.0) + self.alone[job.id] * w
        if job.id in self.done_by:  # requeued after a preemption: its first start no longer counts
            took, at = self.done_by.pop(job.id)
            w = self._weight(at)
            self.done[t] -= took * w
        bisect.insort(self.queues.setdefault(t, []), ((-job.priority, job.gpus * job.estimate), job.id, job))
        if self.overdue:
            heapq.heappush(self.due, (self._due(job), job.id, job))
        p = self.pending.setdefault(t, [0, 0.0, 0.0])
        p[0] += 1
        p[1] += job.submit
        p[2] += job.estimate
        bisect.insort(self.by_estimate, (-job.estimate, -job.gpus, job.id, job))
        self.count += 1
        self.waiting_work += job.gpus * job.estimate
        self.last_any = max(self.last_any, now)

    def _due(self, job: Job) -> float:
        """When the job, still waiting, would take `overdue` x its alone time to complete."""
        return job.submit + self.overdue * self.alone[job.id] - job.estimate

    def remove(self, jobs: list[Job]) -> None:
        for job in jobs:
            _delete(self.queues[job.tenant], ((-job.priority, job.gpus * job.estimate), job.id), job)
            if job.id in self.is_late:
                self.is_late.discard(job.id)
                _delete(self.late, ((-job.priority, self._due(job)), job.id), job)
            p = self.pending[job.tenant]
            p[0] -= 1
            p[1] -= job.submit
            p[2] -= job.estimate
            _delete(self.by_estimate, (-job.estimate, -job.gpus, job.id), job)
            self.count -= 1
            self.waiting_work -= job.gpus * job.estimate
            if not job.preemptible:  # only a preemptible job comes back (and keeps its alone time)
                self.alone.pop(job.id, None)
            self.claims.pop(job.id, None)

    def withdraw(self, jobs: list[Job]) -> None:
        """Jobs that leave unstarted no longer count in their tenant's alone sum (its rho stays its own)."""
        for job in jobs:
            alone = self.alone.get(job.id)
            if alone is not None:
                w = self._weight(job.submit)
                self.alone_sum[job.tenant] -= alone * w
        self.remove(jobs)  # first: a late job is found in the late list by its alone time
        for job in jobs:
            self.alone.pop(job.id, None)

    def finish(self, jobs: list[Job], now: float | None = None) -> None:
        """A preemptible job kept its alone time and its start's share of `done` in case it came back: no more.
        With `now` (when it ended), what it added to its tenant's completion and alone sums on its estimate is
        corrected to what it really ran, and its tenant's private-pool backlog gives back the time it did not use:
        users ask for more than they need, and rho should not say a tenant is served better than it is."""
        for job in jobs:
            self.alone.pop(job.id, None)
            self.done_by.pop(job.id, None)
            start = self.runs.pop(job.id, None)
            if start is None or now is None or not self.learn:
                continue
            delta = min(max(now - start, 0.0), job.estimate) - job.estimate  # <= 0: the part it did not use
            if delta:
                t = job.tenant
                self.done[t] = self.done.get(t, 0.0) + delta * self._weight(start)
                self.alone_sum[t] = self.alone_sum.get(t, 0.0) + delta * self._weight(job.submit)
                if self.backlog.get(t, now) > now:  # on the pool's size at its latest submit
                    self.backlog[t] = max(now, self.backlog[t] + job.gpus * delta / max(self.last_pool.get(t, 1.0), 1.0))

    def waiting(self) -> int:
        return self.count

    def _overdue(self, now: float) -> None:
        """Move jobs whose own wait has made them overdue to the late list (a lazy heap: gone jobs are skipped)."""
        while self.due and self.due[0][0] <= now:
            when, jid, job = heapq.heappop(self.due)
            q = self.queues.get(job.tenant, [])
            i = bisect.bisect_left(q, ((-job.priority, job.gpus * job.estimate), jid))
            if i < len(q) and q[i][2] is job and jid not in self.is_late:
                self.is_late.add(jid)
                bisect.insort(self.late, ((-job.priority, when), jid, job))

    def rho(self, tenant: str, now: float) -> float:
        """The tenant's finish-time fairness so far: completion times (waiting jobs: if they started now) / alone."""
        n, submits, estimates = self.pending.get(tenant, (0, 0.0, 0.0))
        w = self._weight(now)
        done, alone = self.done.get(tenant, 0.0) / w, self.alone_sum.get(tenant, 0.0) / w
        return (done + n * now - submits + estimates) / max(alone, 1e-9)

    def order(self, now: float, state: ClusterState | None = None) -> Iterator[Job]:
        """1. The jobs in the order they are served (lazily): LPT at the end of the queue, behind, the rest."""
        live = {t: q for t, q in self.queues.items() if q}
        first: set[int] = set()
        self._overdue(now)
        if self.claims:  # GPUs were just taken back for them: they go first (priority still comes before all)
            top = max((-q[0][0][0] for q in live.values()), default=0)
            for jid, job in list(self.claims.items()):
                if job.priority >= top:
                    first.add(jid)
                    yield job
        if self.tail and state is not None and live and now - self.last_any >= self.tail_quiet:
            left = self.waiting_work + sum(r.job.gpus * max(r.expected_end - now, 0.0) for r in state.running)
            horizon = self.tail * left / state.capacity
            top = max(-q[0][0][0] for q in live.values())  # priority still comes before all
            for neg, _, jid, job in self.by_estimate:  # the critical jobs, longest (then widest) first
                if -neg < horizon:
                    break
                if job.priority >= top:
                    first.add(jid)
                    yield job
        rank = {t: -r for t in live if (r := self.rho(t, now)) > self.behind}
        self.behind_now = set(rank)
        top = max((-q[0][0][0] for q in live.values()), default=0)
        for (neg_priority, _), jid, job in self.late:  # overdue jobs, the longest overdue first
            if -neg_priority >= top and jid not in first:
                first.add(jid)
                yield job
        self.owed_now: set[int] = set()
        if self.owed and state is not None:  # what each tenant's private pool would run now, beside what it runs
            alloc: dict[str, float] = {}
            for r in state.running:
                alloc[r.job.tenant] = alloc.get(r.job.tenant, 0.0) + r.job.gpus
            active = set(live) | set(alloc)
            total = sum(self.weights.get(t, 1.0) for t in active)
            owed = []
            for t, q in live.items():
                room = max(state.capacity * self.weights.get(t, 1.0) / total, self.widest.get(t, 0)) - alloc.get(t, 0.0)
                for key, jid, job in q:
                    if job.gpus > room:
                        break
                    room -= job.gpus
                    owed.append((key, jid, job))
            owed.sort(key=lambda e: (e[0][0], e[2].submit, e[1]))  # first come first served: reservations hold
            for key, jid, job in owed:
                if -key[0] >= top and jid not in first:
                    first.add(jid)
                    self.owed_now.add(jid)
                    yield job

        if self.sharpness:  # behind tenants' work counts less: their small jobs go first, not all their jobs
            scale = {t: (self.behind / -r) ** self.sharpness for t, r in rank.items()}

            def entry(t: str, i: int) -> tuple:
                (neg_priority, work), jid, _ = live[t][i]
                return (neg_priority, 0, work * scale.get(t, 1.0), 0.0, jid, t, i)
        else:
            def entry(t: str, i: int) -> tuple:
                (neg_priority, work), jid, _ = live[t][i]
                return (neg_priority, 0, rank[t], work, jid, t, i) if t in rank else (neg_priority, 1, 0.0, work, jid, t, i)

        heap = [entry(t, 0) for t in live]
        heapq.heapify(heap)
        while heap:
            *_, t, i = heapq.heappop(heap)
            if i + 1 < len(live[t]):
                heapq.heappush(heap, entry(t, i + 1))
            job = live[t][i][2]
            if job.id not in first:
                yield job

    def quotas(self, state: ClusterState) -> Callable[[str], float]:
        """Each tenant's quota for preemption: its weight's part of the cluster among the tenants that run or wait
        now (itself included)."""
        active = {r.job.tenant for r in state.running} | {t for t, q in self.queues.items() if q}
        total = sum(self.weights.get(t, 1.0) for t in active)

        def quota(tenant: str) -> float:
            w = self.weights.get(tenant, 1.0)
            return state.capacity * w / (total if tenant in active else total + w)

        return quota

    def preempt(self, now: float, state: ClusterState) -> list[Preemption]:
        """Reclaim: preemptible runs of tenants above their quota stop for a tenant whose best waiting job fits its
        quota but no host (see `reclaim`); that job is served first in the next `schedule`."""
        if not any(r.job.preemptible for r in state.running):
            return []
        out = reclaim(self.queues, self.quotas(state), now, state)
        for p in out:
            head = self.queues[p.for_tenant][0][2]
            self.claims[head.id] = head
        return out

    # -- one decision -------------------------------------------------------------------
    def schedule(self, now: float, state: ClusterState) -> list[Start]:
        starts: list[Start] = []
        reserved: Reserved = {}
        holders: set[str] = set()
        looked = 0
        drain = drain_times(now, state) if self.align else None
        for job in self.order(now, state):
            if max(state.free) == 0:
                break
            if fits_somewhere(job, state):  # 2. and 4.
                start = place(job, now, state, reserved, drain)
                if start is not None:
                    state.take(start)
                    starts.append(start)
                    if drain is not None:
                        for h in start.hosts:
                            drain[h] = max(drain[h], now + job.estimate)
                    continue
            looked += 1
            if looked > self.depth:
                break
            if len(holders) < self.reservations and job.tenant not in holders and (
                    not holders or job.tenant in self.behind_now or job.id in self.is_late or job.id in self.owed_now):
                at, spare = reservation(job, now, _with(state, starts, now), exclude=reserved)  # 3.
                if spare:
                    reserved.update({h: [at, s] for h, s in spare.items()})
                    holders.add(job.tenant)
        for s in starts:
            took = now - s.job.submit + s.job.estimate
            w = self._weight(now)  # first: a rebase rescales the sums it reads
            self.done[s.job.tenant] = self.done.get(s.job.tenant, 0.0) + took * w
            self.runs[s.job.id] = now
            if s.job.preemptible:
                self.done_by[s.job.id] = (took, now)
        self.remove([s.job for s in starts])
        return starts


def _delete(items: list, key: tuple, job: Job) -> None:
    """Take `job` out of a sorted list of (key..., id, job) entries."""
    i = bisect.bisect_left(items, key)
    assert items[i][-1] is job, (items[i], key)
    del items[i]
