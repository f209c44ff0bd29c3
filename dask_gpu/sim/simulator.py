"""A discrete-event simulator that drives a queue policy over a workload: what each job did, and the figures.

Time jumps from event to event (a job is submitted, a job ends); ends come
before submits at the same instant, submits in the order given (file order),
and the policy is asked what starts after every one (or, with `batch`, once per
burst of simultaneous events, as the live plugin dispatches). The policy sees
estimates; jobs run for their real duration, but no longer than their time
limit allows (`policies.time_limits`, as the live control plane stops them): a
run past its declared estimate plus the grace is ended and recorded
`time-limit`, or, if it checkpoints (`Job.requeue`), stopped and queued again
to go on from where it stopped. Decision time is process CPU time. Pure Python:
no Prefect, no Dask.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from dask_gpu.policies.fifo import EasyBackfill
from dask_gpu.policies.interface import ClusterState, Job, Policy, Running
from dask_gpu.policies.placement import max_min_shares
from dask_gpu.policies.time_limits import TimeLimits
from dask_gpu.sim.metrics import finish_time_fairness, jain, lower_bound, percentile

Sample = tuple[float, dict[str, int], dict[str, int]]  # (seconds since the first submit, GPUs running, GPUs waiting) per tenant

# -- what the policy is told about a job's length ------------------------------------------------------------
ESTIMATES = ("user", "oracle", "none")
MODES = (900.0, 3600.0, 4 * 3600.0, 12 * 3600.0, 86400.0, 3 * 86400.0)  # the time limits users ask for most
FAR_FRACTION = 0.2  # jobs whose real run is far shorter than asked (they fail early, or ask "to be safe")
FAR_STEPS = 2  # such a job asks for the mode this many steps above the one its run needs


def _unit(seed: int, key: int) -> float:
    """A deterministic draw in [0, 1) for job `key` (the same on every machine and Python)."""
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def user_estimate(duration: float, key: int, seed: int = 0) -> float:
    """What a user asks for a job that really runs `duration` seconds (Tsafrir, Etsion and Feitelson's model,
    simplified): the smallest of `MODES` that holds it; for a seeded `FAR_FRACTION` of jobs, the mode `FAR_STEPS`
    above that (capped at the largest); beyond the largest mode, whole days. Never below `duration`.

    >>> user_estimate(60.0, 1), user_estimate(3600.0, 1), user_estimate(3601.0, 1), user_estimate(4 * 86400.0, 1)
    (900.0, 3600.0, 14400.0, 345600.0)
    """
    if duration > MODES[-1]:
        return math.ceil(duration / 86400.0) * 86400.0
    i = next(k for k, m in enumerate(MODES) if m >= duration)
    if _unit(seed, key) < FAR_FRACTION:
        i = min(i + FAR_STEPS, len(MODES) - 1)
    return MODES[i]


def with_estimates(jobs: list[Job], durations: Mapping[int, float], model: str = "user", seed: int = 0,
                   limit: float | None = None) -> list[Job]:
    """`jobs` with the estimates the policy sees under `model` (they still run for `durations`):

    - `oracle`: the real duration (a bound: no scheduler knows it);
    - `user`: `user_estimate` (rounded up to a modal limit, a fraction asked far too long);
    - `none`: no duration at all, as Tiresias assumes: every job says the same, the cluster's time
      limit `limit` (the largest mode when None), so an order by estimate carries nothing.
    """
    if model == "oracle":
        return [dataclasses.replace(j, estimate=durations[j.id]) for j in jobs]
    if model == "user":
        return [dataclasses.replace(j, estimate=user_estimate(durations[j.id], j.id, seed)) for j in jobs]
    if model == "none":
        return [dataclasses.replace(j, estimate=limit or MODES[-1]) for j in jobs]
    raise ValueError(f"estimates must be one of {', '.join(ESTIMATES)}, not {model!r}")


@dataclass
class Outcome:
    """What one policy did with one workload."""

    policy: str
    jobs: int
    capacity: int
    makespan: float
    lower_bound: float
    mean_jct: float
    p95_jct: float
    mean_wait: float
    utilization: float
    jain: float  # information only: received / max-min share while waiting (the old fairness figure)
    decision_p99_ms: float  # process CPU time of one decision (preempt + schedule)
    preempted: int = 0  # runs stopped to give borrowed GPUs back (requeued, restarted from the beginning)
    wasted_gpu_hours: float = 0.0  # what those runs had done when stopped
    time_limited: int = 0  # runs ended at their time limit (recorded `time-limit`; their work is not done)
    requeued: int = 0  # runs stopped at their time limit and queued again from their checkpoint
    stops: list[tuple[int, float, float]] = field(default_factory=list, repr=False)  # (job id, start, stop) at limits
    started: dict[int, float] = field(default_factory=dict, repr=False)
    ended: dict[int, float] = field(default_factory=dict, repr=False)
    jct: list[float] = field(default_factory=list, repr=False)  # per job, in the order given
    jct_by_tenant: dict[str, float] = field(default_factory=dict, repr=False)  # sum of completion times
    s_active: dict[str, float] = field(default_factory=dict, repr=False)  # GPUs received / max-min share, capped at 1
    rho: dict[str, float] = field(default_factory=dict)  # finish-time fairness, once `with_alone` is given the pools
    rho_slice: dict[str, float] = field(default_factory=dict)  # the same with N = every tenant of the slice (older)
    contention: dict[str, float] = field(default_factory=dict)  # tenants with work, on average, while it had work
    timeline: list[Sample] = field(default_factory=list, repr=False)

    @property
    def makespan_ratio(self) -> float:
        return self.makespan / self.lower_bound if self.lower_bound else float("nan")

    @property
    def max_rho(self) -> float:
        return max(self.rho.values(), default=float("nan"))

    @property
    def max_rho_slice(self) -> float:
        return max(self.rho_slice.values(), default=float("nan"))

    @property
    def min_s_active(self) -> float:
        return min(self.s_active.values(), default=float("nan"))

    def with_alone(self, alone: Mapping[str, float]) -> Outcome:
        """Fill `rho` from each tenant's sum of completion times alone on its private pool."""
        self.rho = finish_time_fairness(self.jct_by_tenant, alone)
        return self

    def with_fairness(self, jobs: list[Job], durations: Mapping[int, float], hosts: int, gpus_per_host: int,
                      cache: dict | None = None) -> Outcome:
        """Fill `rho` as Themis defines it (each tenant's private pool is the cluster / the contention it met here,
        `contention`) and `rho_slice` (the pool is the cluster / every tenant of the slice). `cache` (shared
        between the policies of one slice) keeps alone runs of a tenant on a pool already simulated."""
        cache = {} if cache is None else cache
        self.rho = finish_time_fairness(self.jct_by_tenant, alone(jobs, durations, hosts, gpus_per_host,
                                                                  contention=self.contention, cache=cache))
        self.rho_slice = finish_time_fairness(self.jct_by_tenant, alone(jobs, durations, hosts, gpus_per_host,
                                                                        cache=cache))
        return self


LIVE_LIMITS = TimeLimits()  # the live control plane's defaults (`Settings.time_limit_*`)


def simulate(jobs: list[Job], durations: Mapping[int, float], policy: Policy, hosts: int, gpus_per_host: int,
             resume_preempted: bool = False, sizes: list[int] | None = None, batch: bool = False,
             limits: TimeLimits | None = LIVE_LIMITS) -> Outcome:
    """Replay `jobs` (their real run times in `durations`) through `policy` on hosts x gpus_per_host
    (or hosts of the given `sizes`).

    With `batch`, one scheduling pass follows each burst of simultaneous events (every end and submit at one
    instant), as the live queue plugin dispatches once per turn of its event loop (`PolicyConfig.batch_events`);
    without, one pass follows every event.

    A run the policy preempts is submitted again: from the beginning, or with
    `resume_preempted` from where it stopped (a task that checkpoints).

    With `limits` (the live defaults unless given; None: no limits, the behaviour before issue 42), each job's
    estimate as given is its time limit unless it says `no_limit`: a run that would run longer ends when the limit
    lets it (`TimeLimits.ends`): ended for good (`time_limited`), or with `Job.requeue` queued again with what is
    left (submitted anew at its stop, the same limit), as the live control plane does.
    """
    sizes = list(sizes) if sizes is not None else [gpus_per_host] * hosts
    remaining = dict(durations)
    limit_of = {j.id: None if j.no_limit else j.estimate for j in jobs}  # what each job declared, as given
    first = {j.id: j for j in jobs}
    cut: set[int] = set()  # ids of Running entries whose end event is their time limit
    time_limited = requeued = 0
    stops: list[tuple[int, float, float]] = []
    state = ClusterState(free=list(sizes), size=list(sizes))
    capacity = state.capacity
    events: list[tuple[float, int, int, object]] = []  # (time, 0 = end / 1 = submit, seq, payload)
    for seq, job in enumerate(jobs):
        events.append((job.submit, 1, seq, job))
    heapq.heapify(events)
    seq = len(jobs)
    t0 = min(j.submit for j in jobs)
    started: dict[int, float] = {}
    ended: dict[int, float] = {}
    waiting_gpus: dict[str, int] = {}
    running_gpus: dict[str, int] = {}
    received: dict[str, float] = {}  # while waiting (Jain, information only)
    fair: dict[str, float] = {}
    got: dict[str, float] = {}  # capped share, over the whole active period (s_active)
    active: dict[str, float] = {}
    met: dict[str, float] = {}  # tenant -> integral of (tenants with work) over the time it had work
    held_work = 0.0
    timeline: list[Sample] = []
    decisions: list[float] = []
    stopped: set[int] = set()  # ids of Running entries preempted before their end event
    preempted, wasted = 0, 0.0
    now = t0
    while events:
        t = events[0][0]
        if t > now:  # account the interval [now, t) with the state as it was
            dt = t - now
            demands = {k: running_gpus.get(k, 0) + waiting_gpus.get(k, 0) for k in set(running_gpus) | set(waiting_gpus)}
            demands = {k: v for k, v in demands.items() if v > 0}
            shares = max_min_shares(capacity, demands)
            for tenant, share in shares.items():
                r = running_gpus.get(tenant, 0)
                active[tenant] = active.get(tenant, 0.0) + dt
                met[tenant] = met.get(tenant, 0.0) + len(demands) * dt
                got[tenant] = got.get(tenant, 0.0) + min(r / share, 1.0) * dt
                if waiting_gpus.get(tenant, 0) > 0:
                    received[tenant] = received.get(tenant, 0.0) + r * dt
                    fair[tenant] = fair.get(tenant, 0.0) + share * dt
            now = t
        _, kind, _, payload = heapq.heappop(events)
        if kind == 0:
            run = payload
            assert isinstance(run, Running)
            if id(run) in stopped:  # preempted earlier: this end never happens
                stopped.discard(id(run))
                cut.discard(id(run))
                continue
            state.release(run)
            policy.finish([run.job], now)
            running_gpus[run.job.tenant] -= run.job.gpus
            if id(run) in cut:  # stopped at its time limit
                cut.discard(id(run))
                stops.append((run.job.id, run.start, now))
                if run.job.requeue:  # it stopped at its checkpoint: queued again with what is left, the same limit
                    requeued += 1
                    remaining[run.job.id] -= now - run.start
                    again = dataclasses.replace(first[run.job.id], submit=now,
                                                ran=durations[run.job.id] - remaining[run.job.id])
                    policy.submit(again, state)
                    waiting_gpus[again.tenant] += again.gpus
                else:
                    time_limited += 1
                    ended[run.job.id] = now
            else:
                ended[run.job.id] = now
        else:
            job = payload
            assert isinstance(job, Job)
            policy.submit(job, state)
            waiting_gpus[job.tenant] = waiting_gpus.get(job.tenant, 0) + job.gpus
        if batch and events and events[0][0] == now:
            continue  # the rest of this instant's events first: one pass for the burst
        t_dec = time.process_time()
        for stop in policy.preempt(now, state):
            run = stop.run
            state.release(run)
            running_gpus[run.job.tenant] -= run.job.gpus
            waiting_gpus[run.job.tenant] += run.job.gpus
            stopped.add(id(run))
            preempted += 1
            job = run.job
            if resume_preempted:  # it keeps what it did and says how much is left
                remaining[job.id] -= now - run.start
                job = dataclasses.replace(job, estimate=max(job.estimate - (now - run.start), 0.0))
            else:
                wasted += job.gpus * (now - run.start)
            policy.submit(job, state)  # requeued
        starts = policy.schedule(now, state)
        decisions.append(time.process_time() - t_dec)
        if min(state.free) < 0:
            raise RuntimeError(f"{policy.name} placed more GPUs on a host than it has: free {state.free} at t={now - t0:.0f}s")
        for s in starts:
            run = Running(s.job, s.host, now, s.gang)
            state.running.append(run)
            started.setdefault(s.job.id, now)
            waiting_gpus[s.job.tenant] -= s.job.gpus
            running_gpus[s.job.tenant] = running_gpus.get(s.job.tenant, 0) + s.job.gpus
            runs_for = remaining[s.job.id]
            if limits is not None:
                allowed = limits.allowed(limit_of[s.job.id], first[s.job.id].requeue)
                if runs_for > allowed:
                    runs_for = allowed
                    cut.add(id(run))
            held_work += sum(g for _, g in s.holds) * runs_for
            heapq.heappush(events, (now + runs_for, 0, seq, run))
            seq += 1
        sample = (now - t0, {k: v for k, v in running_gpus.items() if v}, {k: v for k, v in waiting_gpus.items() if v})
        if timeline and timeline[-1][0] == sample[0]:
            timeline[-1] = sample
        else:
            timeline.append(sample)
    if len(ended) != len(jobs):
        raise RuntimeError(f"{policy.name}: {len(jobs) - len(ended)} jobs never ran (wider than the cluster?)")
    jct = [ended[j.id] - j.submit for j in jobs]
    by_tenant: dict[str, float] = {}
    for j, c in zip(jobs, jct):
        by_tenant[j.tenant] = by_tenant.get(j.tenant, 0.0) + c
    makespan = max(ended.values()) - t0
    ratios = [received[k] / fair[k] for k in fair if fair[k] > 0]
    return Outcome(
        policy=policy.name, jobs=len(jobs), capacity=capacity, makespan=makespan,
        lower_bound=lower_bound([j.submit for j in jobs], [j.gpus * durations[j.id] for j in jobs],
                                [durations[j.id] for j in jobs], capacity),
        mean_jct=sum(jct) / len(jct), p95_jct=percentile(jct, 95),
        mean_wait=sum(started[j.id] - j.submit for j in jobs) / len(jobs),
        utilization=held_work / (capacity * makespan) if makespan else 0.0, jain=jain(ratios),
        decision_p99_ms=1000 * percentile(decisions, 99), preempted=preempted, wasted_gpu_hours=wasted / 3600,
        time_limited=time_limited, requeued=requeued, stops=stops,
        started=started, ended=ended, jct=jct, jct_by_tenant=by_tenant,
        s_active={k: got[k] / active[k] for k in active if active[k] > 0}, timeline=timeline,
        contention={k: met[k] / active[k] for k in active if active[k] > 0},
    )


def alone(jobs: list[Job], durations: Mapping[int, float], hosts: int, gpus_per_host: int,
          policy_factory: type[Policy] | None = None, contention: Mapping[str, float] | None = None,
          cache: dict | None = None) -> dict[str, float]:
    """Each tenant's sum of completion times when its jobs run alone under EASY backfill (with the estimates they
    carry) on its private pool (`sim_metrics.private_pool`): the denominator of rho.

    The pool is the cluster / N GPUs, at least the tenant's widest job: N = `contention[tenant]` (Themis: the
    tenants it actually contended with, on average over the time it had work) or, without `contention`, every
    tenant in `jobs`. `cache` maps (tenant, pool, policy) to the sum, so policies of one slice share runs.
    """
    from dask_gpu.sim.metrics import private_pool

    by_tenant: dict[str, list[Job]] = {}
    for j in jobs:
        by_tenant.setdefault(j.tenant, []).append(j)
    factory = policy_factory or EasyBackfill
    cache = {} if cache is None else cache
    out = {}
    for tenant, mine in by_tenant.items():
        n = contention.get(tenant, 1.0) if contention is not None else len(by_tenant)
        pool = private_pool(hosts, gpus_per_host, n, max(j.gpus for j in mine))
        key = (tenant, tuple(pool), factory)
        if key not in cache:
            cache[key] = simulate(mine, durations, factory(), len(pool), gpus_per_host, sizes=pool).jct_by_tenant[tenant]
        out[tenant] = cache[key]
    return out
