"""Where a job fits now, and when it could: best fit, gangs on whole hosts, EASY's reservation, backfill
placement that delays no reservation, max-min shares, and reclaim (the preemptions that give quotas back).

Pure functions over `ClusterState`; every policy with a reservation uses them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from dask_gpu.policies.interface import ClusterState, Holds, Job, Preemption, Running, Start

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


Reserved = dict[int, list[float]]  # host -> [reserved from, GPUs spare there then]


class NoRoom:
    """The shapes (GPUs, estimate) of plain runs (any host, one host) that found no place in one scheduling pass.

    Within a pass, starts only take GPUs and reservations only take room, so a run at least as wide and as long
    as one that found no place finds none either: `place` need not look (a pass over hundreds of waiting runs
    that backfill around a reservation is what a decision with a long queue costs). Decisions stay the same.

    >>> s = ClusterState(free=[2, 0], size=[8, 8]); no = NoRoom(s)
    >>> no.hopeless(Job(0, "a", 4, 0.0, 60.0)), no.saw(Job(0, "a", 4, 0.0, 60.0), fits=False)
    (False, None)
    >>> no.hopeless(Job(1, "a", 8, 0.0, 1.0)), no.hopeless(Job(2, "a", 2, 0.0, 1e6))
    (True, False)
    """

    __slots__ = ("widest", "shapes", "limit")

    def __init__(self, state: ClusterState) -> None:
        self.widest = max(state.size, default=0)
        self.shapes: list[tuple[int, float]] = []  # a Pareto front: no entry both narrower and shorter than another
        self.limit: dict[int, float] = {}  # GPUs -> the shortest estimate that found no place at that width or less

    def _plain(self, job: Job) -> bool:
        return job.hosts is None and job.width <= 1 and job.gpus <= self.widest

    def hopeless(self, job: Job) -> bool:
        """Whether a run no wider and no longer than `job` already found no place this pass."""
        if not self.shapes or job.hosts is not None or job.width > 1 or job.gpus > self.widest:
            return False
        limit = self.limit.get(job.gpus)
        if limit is None:
            limit = self.limit[job.gpus] = min((e for g, e in self.shapes if g <= job.gpus), default=math.inf)
        return job.estimate >= limit

    def saw(self, job: Job, fits: bool) -> None:
        """`job` found no place (`fits`: it fit the free GPUs, but only where it would delay a reservation)."""
        if self._plain(job):
            shape = (job.gpus, job.estimate if fits else 0.0)  # no free room at all: any estimate fails
            self.shapes = [s for s in self.shapes if not (shape[0] <= s[0] and shape[1] <= s[1])] + [shape]
            self.limit.clear()


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


def with_starts(state: ClusterState, starts: list[Start], now: float) -> ClusterState:
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
