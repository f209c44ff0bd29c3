"""Estimates that cannot be gamed: each tenant's declared run times corrected from its own history.

A run's estimate (`est_seconds`) orders the queue (smallest work first), sizes
its alone time (rho) and tells backfill when it ends. A tenant that declares
less than it runs would jump the queue at no cost: the run is not stopped at
its estimate (the budget hold is extended instead). So the policy plans each
run on its estimate x its tenant's *overrun factor*, corrected from that
tenant's history as Tsafrir, Etsion and Feitelson (TPDS 2007) correct each
user's estimates:

    factor = max(1, the largest ran / declared among its last `memory` runs)

counting runs still running past their planned end by what they ran so far
(an overrun is evidence at once, not hours later when the run ends). A tenant
that never ran past its estimate plans on what it declares: honest tenants
are untouched. One that did has every run planned as long as its worst recent
overrun, so under-declaring, by any pattern, plans its runs at least as long
as declaring honestly would (its short runs longer): it never lowers its
expected wait. Pessimistic on purpose: averaging the ratio would plan a liar's
long runs shorter than they are, and they would still pass the others' and
backfill into holes they then overstay (measured: `bench/liar.py`). rho is
kept on what runs really ran (`FairnessBooks.finish` charges an overrun to its
tenant's completion and alone sums), and the tenant's factor is shown with the
queue's status (`GPUQueuePlugin.status()["estimate_factors"]`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque

from dask_gpu.policies.interface import Job
from dask_gpu.policies.time_limits import TimeLimits

REPLAN = 1.1  # a tenant's waiting runs are planned again once its factor grew this much since they were planned
DOWN_AFTER = 5  # runs of a tenant before `learn_down` plans on what they take
REPLAN_BATCH = 32  # at most this many waiting runs planned again per pass, each from its tenant's queue's front


def _size_class(declared: float) -> int:
    """Declared run times within a factor of 2 of each other are one class."""
    return round(math.log2(max(declared, 1.0)))


class Estimates:
    """Per-tenant overrun factors, and the planned view of every job the policy holds (waiting or running)."""

    def __init__(self, memory: float = 100.0, correct: bool = True, limits: TimeLimits | None = None) -> None:
        if not memory >= 1:
            raise ValueError(f"estimate memory must be at least 1 run, not {memory!r}")
        self.memory, self.correct = int(memory), correct  # `correct` False: plan on what was declared (comparison)
        self.limits = limits  # with limits, a run with one is planned no longer than it may run
        self.down = "off"  # plan limited runs on what the tenant's runs take (`learn_down`: "tenant" or "size")
        self.raw: dict[tuple[str, int], deque[float]] = {}  # (tenant, class) -> ran / declared of its last runs
        self.view: dict[int, tuple[Job, float]] = {}  # job id -> (the job as planned, its declared estimate)
        self.ratios: dict[str, deque[float]] = {}  # tenant -> max(1, ran / declared) of its last `memory` runs
        self.past_now: dict[str, float] = {}  # tenant -> the largest ran so far / declared of its runs past their end
        self._factors: dict[str, float] = {}  # cache, dropped for a tenant whenever its history changes

    def factor(self, tenant: str) -> float:
        """What the tenant's estimates are multiplied by: its largest recent ran / declared, at least 1.

        >>> e = Estimates()
        >>> e.factor("a"), e.learn("a", 900.0, 9000.0), e.learn("a", 900.0, 60.0), e.factor("a")
        (1.0, None, None, 10.0)
        >>> e.learn("b", 3600.0, 60.0), e.factor("b")  # asked far too long: not below what it declared
        (None, 1.0)
        """
        if not self.correct:
            return 1.0
        f = self._factors.get(tenant)
        if f is None:
            f = max(1.0, max(self.ratios.get(tenant, ()), default=1.0), self.past_now.get(tenant, 1.0))
            self._factors[tenant] = f
        return f
    def plan(self, job: Job) -> Job:
        """The job as the policy plans it: its estimate x its tenant's factor now, at its first submit and when it
        is entered again as declared (a preempted run's client); the object planned before, requeued, keeps its
        plan; a requeue with another estimate (resumed with what is left) is taken as it comes."""
        known = self.view.get(job.id)
        if known is not None and (known[0] is job or job.estimate != known[1]):
            if known[0] is not job:  # resumed with what is left: the caller's estimate, on the plan's footing
                self.view[job.id] = (job, known[1])
            return job
        f = self.factor(job.tenant)  # new, or entered again as declared (a preempted run's client): planned now
        if f <= 1.0 and self.down != "off" and self.limits is not None and not (job.no_limit or job.requeue):
            # a limit caps how far under the plan it can run: planned on what it takes
            f = self.typical(job.tenant, job.estimate)
        estimate = self._capped(job, job.estimate * f)
        planned = dataclasses.replace(job, estimate=estimate) if estimate != job.estimate else job
        self.view[job.id] = (planned, job.estimate)
        return planned

    def planned(self, job: Job) -> Job:
        """The planned object of a job the caller names by its own object (same id)."""
        known = self.view.get(job.id)
        return known[0] if known is not None else job

    def replan(self, jobs: list[Job]) -> list[tuple[Job, Job]]:
        """(planned, planned again) for waiting `jobs` whose tenant's factor grew by `REPLAN` since they were planned."""
        out = []
        for job in jobs:
            planned, declared = self.view[job.id]
            f = self.factor(job.tenant)
            if declared > 0 and self._capped(planned, declared * f) > planned.estimate * REPLAN:
                again = dataclasses.replace(planned, estimate=self._capped(planned, declared * f))
                self.view[job.id] = (again, declared)
                out.append((planned, again))
        return out

    def typical(self, tenant: str, declared: float) -> float:
        """What a tenant's runs take of what they declare: the median of its last runs (at most 1; 1 with fewer than
        `DOWN_AFTER`), Tsafrir's prediction from a user's history, downward only. `learn_down="size"` keeps a
        history per size of run (declared within a factor of 2), because users round up to a few limits (15 min,
        1 h, 4 h) and a tenant's one-hour runs say little of how much of its four-hour ones it uses; "tenant" keeps
        one for all its runs (measured: it takes a liar's gain away more surely, and costs honest days more)."""
        raw = self.raw.get((tenant, self._class(declared)))
        if not raw or len(raw) < DOWN_AFTER:
            return 1.0
        v = sorted(raw)
        return min(1.0, max(v[len(v) // 2], 0.01))

    def _class(self, declared: float) -> int:
        return _size_class(declared) if self.down == "size" else 0

    def _capped(self, job: Job, estimate: float) -> float:
        """A run with a time limit cannot hold its GPUs past its limit and the grace: planned no longer than that.
        One with no limit is planned no shorter than the operator's `no_limit_plan`."""
        if self.limits is None:
            return estimate
        if job.no_limit:
            return self.limits.planned_no_limit(estimate)
        if job.requeue:  # (one that requeues comes back: its work orders it)
            return estimate
        return min(estimate, self.limits.planned(self.declared_of(job)))

    def learn(self, tenant: str, declared: float, ran: float) -> None:
        """A run of `tenant` that declared `declared` seconds ended after `ran` (only its last `memory` runs count)."""
        if declared > 0:
            self.ratios.setdefault(tenant, deque(maxlen=self.memory)).append(max(1.0, ran / declared))
            if self.down != "off":
                self.raw.setdefault((tenant, self._class(declared)), deque(maxlen=self.memory)).append(ran / declared)
            self._factors.pop(tenant, None)

    def forget(self, job: Job) -> float | None:
        """The job left the policy for good: its declared estimate (None if it was never planned)."""
        known = self.view.pop(job.id, None)
        return None if known is None else known[1]

    def declared_of(self, job: Job) -> float:
        known = self.view.get(job.id)
        return known[1] if known is not None else job.estimate

    def running_past(self, now: float, runs: list[tuple[str, float, float, float]]) -> None:
        """Runs still running past their planned end count now: (tenant, start, planned estimate, declared) each;
        what they ran so far, against what they declared (rounded down to a power of 2), joins their tenant's
        factor until they end."""
        past: dict[str, float] = {}
        for tenant, start, planned, declared in runs:
            if now - start > planned and declared > 0:
                seen = 2.0 ** math.floor(math.log2((now - start) / declared))  # by doublings: replanned seldom
                past[tenant] = max(past.get(tenant, 1.0), seen)
        for tenant in set(past) | set(self.past_now):
            self._factors.pop(tenant, None)
        self.past_now = past

    def plan_of(self, job_id: int) -> dict[str, float] | None:
        """What the queue planned a run on, for its evidence (`aisched explain`): its declared estimate, its tenant's
        factor then, and the planned estimate; None for a run it does not hold.

        >>> e = Estimates()
        >>> e.learn("a", 600.0, 1080.0), e.plan(Job(1, "a", 1, 0.0, 600.0)).estimate, e.plan_of(1)
        (None, 1080.0, {'declared': 600.0, 'factor': 1.8, 'planned': 1080.0})
        """
        known = self.view.get(job_id)
        if known is None:
            return None
        planned, declared = known
        factor = planned.estimate / declared if declared > 0 else 1.0
        if planned.no_limit and self.limits is not None and planned.estimate <= self.limits.no_limit_plan:
            # planned on the default run time, not on its tenant's history: say both
            return {"declared": declared, "factor": round(self.factor(planned.tenant), 6),
                    "planned": planned.estimate, "no_limit_plan": self.limits.no_limit_plan}
        return {"declared": declared, "factor": round(factor, 6), "planned": planned.estimate}

    def status(self) -> dict[str, float]:
        """Each tenant's factor, for people (`aisched cluster`): 1.0 for a tenant that never ran past its estimate."""
        return {t: round(self.factor(t), 3) for t in sorted(set(self.ratios) | set(self.past_now))}


class EstimatePlanning:
    """The part of `FinishTimeFair` that plans on corrected estimates (a mixin: it works on that policy's queue and
    `FairnessBooks`): it learns each tenant's factor as runs end or pass their planned end, and plans its waiting
    runs again when the factor grew."""

    def _open_estimates(self, memory: float, correct: bool = True, limits: TimeLimits | None = None) -> None:
        self.estimates = Estimates(memory, correct, limits)
        self.planned_at: dict[str, float] = {}  # tenant -> its factor when its waiting runs were last planned
        self.stale: dict[str, set[int]] = {}  # tenant -> its waiting runs planned on an older factor (not yet again)

    def finish(self, jobs: list[Job], now: float | None = None) -> None:
        """As `FairnessBooks.finish`; with `now`, what each run really ran also teaches its tenant's factor."""
        jobs = [self.estimates.planned(j) for j in jobs]
        if now is not None and self.learn:
            for job in jobs:
                start = self.runs.get(job.id)
                if start is not None:
                    # a run requeued at its limit counts with what it ran before: its job's whole run so far
                    self.estimates.learn(job.tenant, self.estimates.declared_of(job), job.ran + max(now - start, 0.0))
        super().finish(jobs, now)
        for job in jobs:
            self.estimates.forget(job)
        for tenant in sorted({j.tenant for j in jobs}):  # (sorted: replays do not depend on hashing)
            self._replan(tenant, 0)  # (the next pass plans its runs again)

    def _learn_running(self, now: float, state) -> None:
        """Runs past their planned end count in their tenant's factor now (the first overruns of a tenant that
        under-declares are seen when they happen, not hours later)."""
        if not self.learn:
            return
        view, past = self.estimates.view, []
        for r in state.running:
            known = view.get(r.job.id)
            if known is not None and now - r.start > known[0].estimate:
                past.append((r.job.tenant, r.start, known[0].estimate, known[1]))
        if past or self.estimates.past_now:
            self.estimates.running_past(now, past)
            for tenant in sorted({p[0] for p in past}):
                self._replan(tenant, 0)
        budget = REPLAN_BATCH
        for tenant in [t for t, ids in self.stale.items() if ids]:
            if budget <= 0:
                break
            budget -= self._replan(tenant, budget)

    def _replan(self, tenant: str, budget: int) -> int:
        """The tenant's waiting runs, planned again on its factor once it grew by `REPLAN`: each keeps its alone
        time grown by what its estimate grew, and its private pool's backlog is pushed out as much. At most
        `budget` runs (`REPLAN_BATCH` per pass over all tenants), from the front of its queue (the runs served next;
        the rest in later passes), so a decision stays fast with thousands queued. How many it looked at."""
        f = self.estimates.factor(tenant)
        q = self.queues.get(tenant)
        if f > self.planned_at.get(tenant, 1.0) * REPLAN:
            self.planned_at[tenant] = f
            if q:
                self.stale[tenant] = {jid for _, jid, _ in q}
        stale = self.stale.get(tenant)
        if not stale or budget <= 0:
            return 0
        front = [e[2] for e in (q or [])[: 4 * budget] if e[1] in stale][:budget]
        stale.difference_update(j.id for j in front)
        for old, new in self.estimates.replan(front):
            claimed = self.claims.pop(old.id, None) is not None
            self._unqueue(old)  # first: a late job is found in the late list by its alone time
            grow = new.estimate - old.estimate
            self.pending[tenant][2] += grow
            self.alone[new.id] += grow
            w = self._weight(new.submit)  # first: a rebase rescales the sums it reads
            self.alone_sum[tenant] += grow * w
            if tenant in self.backlog:
                self.backlog[tenant] += new.gpus * grow / max(self.last_pool.get(tenant, 1.0), 1.0)
            self._queue(new)
            if claimed:
                self.claims[new.id] = new
        return max(len(front), 1)
