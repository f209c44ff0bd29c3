"""`FinishTimeFair`: the live queue's default policy, and ours in the simulator.

Shortest first, with jobs about to finish much later than they would alone on their tenant's share served first;
no GPU held idle beyond EASY's reservations. Its fairness accounting is `fairness_books.FairnessBooks`.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterator

from dask_gpu.policies.estimates import EstimatePlanning
from dask_gpu.policies.fairness_books import FairnessBooks
from dask_gpu.policies.fifo import EasyBackfill
from dask_gpu.policies.interface import ClusterState, Job, Preemption, Start
from dask_gpu.policies.placement import NoRoom, Reserved, drain_times, fits_somewhere, place, reclaim, reservation, with_starts
from dask_gpu.policies.starvation import StarvationBound
from dask_gpu.policies.time_limits import TimeLimits

LIVE_HALF_LIFE = 7 * 24 * 3600.0  # the live queue's fairness memory halves weekly (Slurm's PriorityDecayHalfLife)


class FinishTimeFair(EstimatePlanning, StarvationBound, FairnessBooks, EasyBackfill):
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
    since the scheduler started. The live configuration (`config.PolicyConfig`,
    which the plugin and the benches build it from) fades with a 7-day
    half-life (`LIVE_HALF_LIFE`, as Slurm's PriorityDecayHalfLife); the
    constructor's default is None (never fade).

    Estimates: each job is planned on its declared estimate x its tenant's
    overrun factor (`estimates.Estimates`, with `correct_estimates`), so
    declaring short buys no place in the queue. With `time_limits` (the live configuration's), a run's estimate is
    its limit: it is planned on no more than its limit plus the grace (it cannot hold its GPUs longer), and a run
    declared with no limit (`Job.no_limit`) is planned on at least the limits' `no_limit_plan` and its tenant's
    factor, and its overrun charged at the premium (`time_limits`).

    With `starve_after`, a light tenant's run that waited that long goes first, on a reservation (`starvation`).

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
                 sharpness: float = 4.0, estimate_memory: float = 100.0, correct_estimates: bool = True,
                 starve_after: float = 0.0, time_limits: TimeLimits | None = None, learn_down: str = "off") -> None:
        super().__init__()
        self._open_books(weights, horizon, half_life, learn, time_limits)
        self._open_estimates(estimate_memory, correct_estimates, time_limits)
        self.estimates.down = learn_down
        self.owed = owed
        self.behind, self.overdue, self.reservations = behind, overdue, reservations
        self.due: list[tuple[float, int, Job]] = []  # heap: (when a job's own wait makes it overdue, id, job)
        self.late: list[tuple[tuple[int, float], int, Job]] = []  # overdue jobs: ((-priority, when), id, job)
        self.is_late: set[int] = set()
        self.tail, self.tail_quiet, self.align = tail, tail_quiet, align
        self.queues: dict[str, list[tuple[tuple[int, float], int, Job]]] = {}  # ((-priority, work), id, job)
        self.by_estimate: list[tuple[float, int, int, Job]] = []  # waiting jobs, longest then widest first
        self.count = 0
        self.waiting_work = 0.0
        self.last_any = -math.inf
        self.claims: dict[int, Job] = {}  # waiting jobs that runs were preempted for: served first
        self.sharpness = sharpness
        self._open_starvation(starve_after)

    # -- the queue ----------------------------------------------------------------------
    def submit(self, job: Job, state: ClusterState) -> None:
        job = self.estimates.plan(job)  # on its tenant's overrun factor (`estimates`)
        self._enter_books(job, state.capacity)
        self._queue(job)

    def _queue(self, job: Job) -> None:
        bisect.insort(self.queues.setdefault(job.tenant, []), ((-job.priority, job.gpus * job.estimate), job.id, job))
        if self.overdue:
            heapq.heappush(self.due, (self._due(job), job.id, job))
        bisect.insort(self.by_estimate, (-job.estimate, -job.gpus, job.id, job))
        self._waits(job)
        self.count += 1
        self.waiting_work += job.gpus * job.estimate
        self.last_any = max(self.last_any, job.submit)

    def _due(self, job: Job) -> float:
        """When the job, still waiting, would take `overdue` x its alone time to complete."""
        return job.submit + self.overdue * self.alone[job.id] - job.estimate

    def _unqueue(self, job: Job) -> None:
        _delete(self.queues[job.tenant], ((-job.priority, job.gpus * job.estimate), job.id), job)
        if job.id in self.is_late:
            self.is_late.discard(job.id)
            _delete(self.late, ((-job.priority, self._due(job)), job.id), job)
        _delete(self.by_estimate, (-job.estimate, -job.gpus, job.id), job)
        self._waits_no_more(job)
        self.count -= 1
        self.waiting_work -= job.gpus * job.estimate

    def remove(self, jobs: list[Job]) -> None:
        for job in jobs:
            job = self.estimates.planned(job)
            self._unqueue(job)
            self._leave_books(job)  # last: a late job is found in the late list by its alone time
            self.claims.pop(job.id, None)
            if self.stale.get(job.tenant):
                self.stale[job.tenant].discard(job.id)

    def withdraw(self, jobs: list[Job]) -> None:
        """Jobs that leave unstarted no longer count in their tenant's alone sum (its rho stays its own)."""
        jobs = [self.estimates.planned(j) for j in jobs]
        for job in jobs:
            self._withdraw_books(job)
        self.remove(jobs)  # first: a late job is found in the late list by its alone time
        for job in jobs:
            self.alone.pop(job.id, None)
            self.estimates.forget(job)

    def started(self, jobs: list[Job], now: float) -> None:
        """Started outside `schedule` (a fraction on a shared device, a warm body's reuse): counted as its own."""
        jobs = [self.estimates.planned(j) for j in jobs]
        self.remove(jobs)
        for job in jobs:
            self._start_books(job, now)

    def waiting(self) -> int:
        return self.count

    def order(self, now: float, state: ClusterState | None = None) -> Iterator[Job]:
        """1. The jobs in the order they are served (lazily): LPT at the end of the queue, behind, the rest."""
        live = {t: q for t, q in self.queues.items() if q}
        first: set[int] = set()
        _move_overdue(self, now)
        if self.claims:  # GPUs were just taken back for them: they go first (priority still comes before all)
            top = max((-q[0][0][0] for q in live.values()), default=0)
            for jid, job in list(self.claims.items()):
                if job.priority >= top:
                    first.add(jid)
                    yield job
        self.starved_now = set()
        if self.starve_after and state is not None and live:  # starved runs of light tenants (`starvation`)
            top = max(-q[0][0][0] for q in live.values())  # priority still comes before all
            for job in self.starved(now, state):
                if job.priority >= top and job.id not in first:
                    first.add(job.id)
                    self.starved_now.add(job.id)
                    yield job
        if self.tail and state is not None and live and now - self.last_any >= self.tail_quiet:
            left = self.waiting_work + sum(r.job.gpus * max(r.expected_end - now, 0.0) for r in state.running)
            horizon = self.tail * left / state.capacity
            top = max(-q[0][0][0] for q in live.values())  # priority still comes before all
            for neg, _, jid, job in self.by_estimate:  # the critical jobs, longest (then widest) first
                if -neg < horizon:
                    break
                if job.priority >= top and jid not in first:  # (a claim or a starved run: yielded)
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
        self._learn_running(now, state)
        starts: list[Start] = []
        reserved: Reserved = {}
        holders: set[str] = set()
        looked = 0
        drain = drain_times(now, state) if self.align else None
        no_room = NoRoom(state)  # shapes that found no place: a wider and longer run is not tried (same decisions)
        for job in self.order(now, state):
            if max(state.free) == 0:
                break
            if no_room.hopeless(job):
                pass
            elif fits_somewhere(job, state):  # 2. and 4.
                start = place(job, now, state, reserved, drain)
                if start is not None:
                    state.take(start)
                    starts.append(start)
                    if drain is not None:
                        for h in start.hosts:
                            drain[h] = max(drain[h], now + job.estimate)
                    continue
                no_room.saw(job, fits=True)
            else:
                no_room.saw(job, fits=False)
            looked += 1
            if looked > self.depth:
                break
            if job.id in self.starved_now or len(holders) < self.reservations and job.tenant not in holders and (
                    not holders or job.tenant in self.behind_now or job.id in self.is_late or job.id in self.owed_now):
                at, spare = reservation(job, now, with_starts(state, starts, now),  # 3.
                                        exclude=reserved)
                if spare:
                    reserved.update({h: [at, s] for h, s in spare.items()})
                    holders.add(job.tenant)
        for s in starts:
            self._start_books(s.job, now)
        self.remove([s.job for s in starts])
        return starts




def _delete(items: list, key: tuple, job: Job) -> None:
    """Take `job` out of a sorted list of (key..., id, job) entries."""
    i = bisect.bisect_left(items, key)
    assert items[i][-1] is job, (items[i], key)
    del items[i]


def _move_overdue(policy: FinishTimeFair, now: float) -> None:
    """Move jobs whose own wait has made them overdue to the late list (a lazy heap: gone jobs are skipped)."""
    while policy.due and policy.due[0][0] <= now:
        when, jid, job = heapq.heappop(policy.due)
        q = policy.queues.get(job.tenant, [])
        i = bisect.bisect_left(q, ((-job.priority, job.gpus * job.estimate), jid))
        if i < len(q) and q[i][2] is job and jid not in policy.is_late:
            policy.is_late.add(jid)
            bisect.insort(policy.late, ((-job.priority, when), jid, job))
