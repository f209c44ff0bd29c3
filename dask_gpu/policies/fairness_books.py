"""The finish-time fairness accounting `FinishTimeFair` orders by: each tenant's rho so far (Themis, online).

Each job gets, at its first submit, an *alone* completion time: how long it
would take if its tenant had a private pool of the cluster's GPUs x its
weight's part (among tenants that submitted within `horizon`; at least its
widest job so far) and ran its jobs there in submit order (a backlog clock per
tenant). A tenant's rho now is the sum of its jobs' completion times so far
(started: start - submit + estimate; waiting: now - submit + estimate) over
the sum of their alone times. With `learn`, a run's terms are corrected to its
real run time when it ends. With `half_life`, every term fades with a weight
halving every `half_life` seconds.
"""

from __future__ import annotations

from dask_gpu.policies.interface import Job
from dask_gpu.policies.time_limits import TimeLimits


class FairnessBooks:
    """Per-tenant sums for rho, kept as jobs enter, start, leave and end; a mixin of `FinishTimeFair`.

    Every job is in these books from its first submit until `finish` (or a withdrawal) and started at most once
    at a time (`runs`); a preemptible job keeps its alone time across a requeue and its first start's share of
    `done` is taken back when it comes back.
    """

    def _open_books(self, weights: dict[str, float] | None, horizon: float, half_life: float | None,
                    learn: bool, time_limits: TimeLimits | None = None) -> None:
        if half_life is not None and not half_life > 0:
            raise ValueError(f"half_life must be positive seconds or None (never fade), not {half_life!r}")
        self.weights = weights or {}
        self.horizon, self.half_life, self.learn = horizon, half_life, learn
        self.premium = time_limits.no_limit_premium if time_limits is not None else 1.0  # a no-limit run's overrun
        self.epoch: float | None = None  # `done` and `alone_sum` are stored x 2**((t - epoch) / half_life)
        self.backlog: dict[str, float] = {}  # tenant -> when its private pool would be idle
        self.widest: dict[str, int] = {}  # tenant -> its widest job so far (its pool is at least that)
        self.last_submit: dict[str, float] = {}
        self.alone: dict[int, float] = {}  # job id -> its completion time alone
        self.alone_sum: dict[str, float] = {}  # tenant -> sum of its jobs' alone times (stored scaled, see `_weight`)
        self.done: dict[str, float] = {}  # tenant -> sum of (start - submit + estimate) of its started jobs (scaled)
        self.done_by: dict[int, tuple[float, float]] = {}  # job id -> (what it added to done, when): taken back if
        # it is requeued
        self.pending: dict[str, list[float]] = {}  # tenant -> [jobs waiting, sum of submit, sum of estimate]
        self.runs: dict[int, float] = {}  # running job id -> its start (to learn its real run time at `finish`)
        self.last_pool: dict[str, float] = {}  # tenant -> its private pool's GPUs at its latest submit

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

        >>> from dask_gpu.policies.finish_time_fair import FinishTimeFair
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

    def _enter_books(self, job: Job, capacity: int) -> None:
        """A job waits: at its first submit it gets its alone time; a requeued one gives back its start's share."""
        now, t = job.submit, job.tenant
        self.last_submit[t] = max(now, self.last_submit.get(t, now))
        if job.id not in self.alone:
            self.widest[t] = max(self.widest.get(t, 0), job.gpus)
            gpus = max(self.pool(t, now, capacity), self.widest[t])
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
        self.runs.pop(job.id, None)  # (a requeued job runs no more)
        p = self.pending.setdefault(t, [0, 0.0, 0.0])
        p[0] += 1
        p[1] += job.submit
        p[2] += job.estimate

    def _leave_books(self, job: Job) -> None:
        """A job stops waiting (started or gone); only a preemptible job may come back (and keeps its alone time)."""
        p = self.pending[job.tenant]
        p[0] -= 1
        p[1] -= job.submit
        p[2] -= job.estimate
        if not job.preemptible:
            self.alone.pop(job.id, None)

    def _withdraw_books(self, job: Job) -> None:
        """A job leaves unstarted: it no longer counts in its tenant's alone sum (its rho stays its own)."""
        alone = self.alone.get(job.id)
        if alone is not None:
            self.alone_sum[job.tenant] -= alone * self._weight(job.submit)

    def _start_books(self, job: Job, now: float) -> None:
        """A job starts at `now`: its completion time so far (start - submit + estimate) counts as done."""
        took = now - job.submit + job.estimate
        w = self._weight(now)  # first: a rebase rescales the sums it reads
        self.done[job.tenant] = self.done.get(job.tenant, 0.0) + took * w
        self.runs[job.id] = now
        if job.preemptible:
            self.done_by[job.id] = (took, now)

    def finish(self, jobs: list[Job], now: float | None = None) -> None:
        """A preemptible job kept its alone time and its start's share of `done` in case it came back: no more.
        With `now` (when it ended), what it added to its tenant's completion and alone sums on its estimate is
        corrected to what it really ran, and its tenant's private-pool backlog gives back the time it did not use:
        users ask for more than they need, and rho should not say a tenant is served better than it is. A run
        that ran past its estimate is charged the same way (both sums grow by the overrun); one declared with no
        limit is charged at the premium: its alone sum grows `premium` x its overrun, so its tenant's rho falls
        (it counts as served better) and its later runs wait behind honest ones."""
        for job in jobs:
            self.alone.pop(job.id, None)
            self.done_by.pop(job.id, None)
            start = self.runs.pop(job.id, None)
            if start is None or now is None or not self.learn:
                continue
            delta = max(now - start, 0.0) - job.estimate  # < 0: the part it did not use; > 0: its overrun
            if delta:
                t = job.tenant
                self.done[t] = self.done.get(t, 0.0) + delta * self._weight(start)
                charged = delta * self.premium if delta > 0 and job.no_limit else delta
                self.alone_sum[t] = self.alone_sum.get(t, 0.0) + charged * self._weight(job.submit)
                if self.backlog.get(t, now) > now:  # on the pool's size at its latest submit
                    self.backlog[t] = max(now, self.backlog[t] + job.gpus * delta / max(self.last_pool.get(t, 1.0), 1.0))

    def rho(self, tenant: str, now: float) -> float:
        """The tenant's finish-time fairness so far: completion times (waiting jobs: if they started now) / alone."""
        n, submits, estimates = self.pending.get(tenant, (0, 0.0, 0.0))
        w = self._weight(now)
        done, alone = self.done.get(tenant, 0.0) / w, self.alone_sum.get(tenant, 0.0) / w
        return (done + n * now - submits + estimates) / max(alone, 1e-9)

