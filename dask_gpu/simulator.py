"""A discrete-event simulator that drives a queue policy over a workload: what each job did, and the figures.

Time jumps from event to event (a job is submitted, a job ends); each event is
handled on its own, as a live scheduler sees them one message at a time: ends
before submits at the same instant, submits in the order given (file order),
and the policy is asked what starts after every one. The policy sees
estimates; jobs run for their real duration. Decision time is process CPU
time. Pure Python: no Prefect, no Dask.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from dask_gpu.queue_policy import ClusterState, Job, Policy, Running, max_min_shares
from dask_gpu.sim_metrics import finish_time_fairness, jain, lower_bound, percentile

Sample = tuple[float, dict[str, int], dict[str, int]]  # (seconds since the first submit, GPUs running, GPUs waiting) per tenant


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
    started: dict[int, float] = field(default_factory=dict, repr=False)
    ended: dict[int, float] = field(default_factory=dict, repr=False)
    jct: list[float] = field(default_factory=list, repr=False)  # per job, in the order given
    jct_by_tenant: dict[str, float] = field(default_factory=dict, repr=False)  # sum of completion times
    s_active: dict[str, float] = field(default_factory=dict, repr=False)  # GPUs received / max-min share, capped at 1
    rho: dict[str, float] = field(default_factory=dict)  # finish-time fairness, once `with_alone` is given the pools
    timeline: list[Sample] = field(default_factory=list, repr=False)

    @property
    def makespan_ratio(self) -> float:
        return self.makespan / self.lower_bound if self.lower_bound else float("nan")

    @property
    def max_rho(self) -> float:
        return max(self.rho.values(), default=float("nan"))

    @property
    def min_s_active(self) -> float:
        return min(self.s_active.values(), default=float("nan"))

    def with_alone(self, alone: Mapping[str, float]) -> Outcome:
        """Fill `rho` from each tenant's sum of completion times alone on its private pool."""
        self.rho = finish_time_fairness(self.jct_by_tenant, alone)
        return self


def simulate(jobs: list[Job], durations: Mapping[int, float], policy: Policy, hosts: int, gpus_per_host: int,
             resume_preempted: bool = False, sizes: list[int] | None = None) -> Outcome:
    """Replay `jobs` (their real run times in `durations`) through `policy` on hosts x gpus_per_host
    (or hosts of the given `sizes`).

    A run the policy preempts is submitted again: from the beginning, or with
    `resume_preempted` from where it stopped (a task that checkpoints).
    """
    sizes = list(sizes) if sizes is not None else [gpus_per_host] * hosts
    remaining = dict(durations)
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
                continue
            state.release(run)
            policy.finish([run.job])
            running_gpus[run.job.tenant] -= run.job.gpus
            ended[run.job.id] = now
        else:
            job = payload
            assert isinstance(job, Job)
            policy.submit(job, state)
            waiting_gpus[job.tenant] = waiting_gpus.get(job.tenant, 0) + job.gpus
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
            held_work += sum(g for _, g in s.holds) * remaining[s.job.id]
            heapq.heappush(events, (now + remaining[s.job.id], 0, seq, run))
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
        started=started, ended=ended, jct=jct, jct_by_tenant=by_tenant,
        s_active={k: got[k] / active[k] for k in active if active[k] > 0}, timeline=timeline,
    )


def alone(jobs: list[Job], durations: Mapping[int, float], hosts: int, gpus_per_host: int,
          policy_factory: type[Policy] | None = None) -> dict[str, float]:
    """Each tenant's sum of completion times when its jobs run alone under EASY backfill on its private
    pool (`sim_metrics.private_pool`, N = the tenants in `jobs`): the denominator of rho."""
    from dask_gpu.queue_policy import EasyBackfill
    from dask_gpu.sim_metrics import private_pool

    by_tenant: dict[str, list[Job]] = {}
    for j in jobs:
        by_tenant.setdefault(j.tenant, []).append(j)
    out = {}
    for tenant, mine in by_tenant.items():
        pool = private_pool(hosts, gpus_per_host, len(by_tenant), max(j.gpus for j in mine))
        policy = (policy_factory or EasyBackfill)()
        out[tenant] = simulate(mine, durations, policy, len(pool), gpus_per_host, sizes=pool).jct_by_tenant[tenant]
    return out
