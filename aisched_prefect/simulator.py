"""A discrete-event simulator that drives a queue policy over a workload, and the figures to compare policies.

Time jumps from event to event (a job is submitted, a job ends); at each
event the policy is told of new jobs and asked what starts. The policy sees
estimates; jobs run for their real duration.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from dataclasses import dataclass, field

from dask_gpu.queue_policy import ClusterState, Job, Policy, Running, max_min_shares


@dataclass
class Outcome:
    """What one policy did with one workload."""

    policy: str
    jobs: int
    makespan: float
    lower_bound: float
    mean_jct: float
    p95_jct: float
    mean_wait: float
    utilization: float
    jain: float
    decision_p99_ms: float
    preempted: int = 0  # runs stopped to give borrowed GPUs back (requeued, restarted from the beginning)
    wasted_gpu_hours: float = 0.0  # what those runs had done when stopped
    timeline: list[tuple[float, int, int]] = field(default_factory=list, repr=False)  # (t, busy GPUs, queued jobs)

    @property
    def makespan_ratio(self) -> float:
        return self.makespan / self.lower_bound if self.lower_bound else float("nan")


def lower_bound(jobs: list[Job], durations: dict[int, float], gpus: int) -> float:
    """LB+: no schedule can finish earlier (measured from the first submit)."""
    t0 = min(j.submit for j in jobs)
    work = sum(j.gpus * durations[j.id] for j in jobs)
    bound = max(work / gpus, max(j.submit - t0 + durations[j.id] for j in jobs))
    later = 0.0
    for j in sorted(jobs, key=lambda j: j.submit, reverse=True):  # t + work submitted at or after t, / GPUs
        later += j.gpus * durations[j.id]
        bound = max(bound, j.submit - t0 + later / gpus)
    return bound


def jain(values: list[float]) -> float:
    return (sum(values) ** 2) / (len(values) * sum(v * v for v in values)) if values and any(values) else 1.0


def simulate(jobs: list[Job], durations: dict[int, float], policy: Policy, hosts: int, gpus_per_host: int,
             resume_preempted: bool = False) -> Outcome:
    """Replay `jobs` (their real run times in `durations`) through `policy` on hosts x gpus_per_host.

    A run the policy preempts is submitted again: from the beginning, or with
    `resume_preempted` from where it stopped (a task that checkpoints).
    """
    remaining = dict(durations)
    state = ClusterState(free=[gpus_per_host] * hosts)
    capacity = hosts * gpus_per_host
    events: list[tuple[float, int, int, object]] = []  # (time, 0 = end / 1 = submit, seq, payload)
    seq = 0
    for job in jobs:
        heapq.heappush(events, (job.submit, 1, seq, job))
        seq += 1
    t0 = min(j.submit for j in jobs)
    started: dict[int, float] = {}
    ended: dict[int, float] = {}
    waiting_gpus: dict[str, float] = {}
    running_gpus: dict[str, float] = {}
    received: dict[str, float] = {}
    fair: dict[str, float] = {}
    timeline: list[tuple[float, int, int]] = []
    decisions: list[float] = []
    stopped: set[int] = set()  # ids of Running entries preempted before their end event
    preempted, wasted = 0, 0.0
    now = t0
    while events:
        t = events[0][0]
        if t > now:  # account the interval [now, t) with the state as it was
            dt = t - now
            demands = {k: running_gpus.get(k, 0.0) + waiting_gpus.get(k, 0.0) for k in set(running_gpus) | set(waiting_gpus)}
            demands = {k: v for k, v in demands.items() if v > 0}
            shares = max_min_shares(capacity, demands)
            for tenant, w in waiting_gpus.items():
                if w > 0:  # counted only while the tenant has work waiting
                    received[tenant] = received.get(tenant, 0.0) + running_gpus.get(tenant, 0.0) * dt
                    fair[tenant] = fair.get(tenant, 0.0) + shares.get(tenant, 0.0) * dt
            now = t
        while events and events[0][0] == now:
            _, kind, _, payload = heapq.heappop(events)
            if kind == 0:
                run = payload
                assert isinstance(run, Running)
                if id(run) in stopped:  # preempted earlier: this end never happens
                    stopped.discard(id(run))
                    continue
                state.running.remove(run)
                state.free[run.host] += run.job.gpus
                running_gpus[run.job.tenant] -= run.job.gpus
                ended[run.job.id] = now
            else:
                job = payload
                assert isinstance(job, Job)
                policy.submit(job, state)
                waiting_gpus[job.tenant] = waiting_gpus.get(job.tenant, 0.0) + job.gpus
        t_dec = time.perf_counter()
        for stop in policy.preempt(now, state):
            run = stop.run
            state.running.remove(run)
            state.free[run.host] += run.job.gpus
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
        decisions.append(time.perf_counter() - t_dec)
        if min(state.free) < 0:
            raise RuntimeError(f"{policy.name} placed more GPUs on a host than it has: free {state.free} at t={now - t0:.0f}s")
        for s in starts:
            run = Running(s.job, s.host, now)
            state.running.append(run)
            started[s.job.id] = now
            waiting_gpus[s.job.tenant] -= s.job.gpus
            running_gpus[s.job.tenant] = running_gpus.get(s.job.tenant, 0.0) + s.job.gpus
            heapq.heappush(events, (now + remaining[s.job.id], 0, seq, run))
            seq += 1
        timeline.append((now - t0, capacity - sum(state.free), policy.waiting()))
    if len(ended) != len(jobs):
        raise RuntimeError(f"{policy.name}: {len(jobs) - len(ended)} jobs never ran (larger than any host?)")
    jct = sorted(ended[j.id] - j.submit for j in jobs)
    makespan = max(ended.values()) - t0
    work = sum(j.gpus * durations[j.id] for j in jobs)
    ratios = [received[k] / fair[k] for k in fair if fair[k] > 0]
    decisions.sort()
    return Outcome(
        policy=policy.name, jobs=len(jobs), makespan=makespan, lower_bound=lower_bound(jobs, durations, capacity),
        mean_jct=sum(jct) / len(jct), p95_jct=jct[min(len(jct) - 1, int(0.95 * len(jct)))],
        mean_wait=sum(started[j.id] - j.submit for j in jobs) / len(jobs),
        utilization=work / (capacity * makespan), jain=jain(ratios),
        decision_p99_ms=1000 * decisions[min(len(decisions) - 1, int(0.99 * len(decisions)))], timeline=timeline,
        preempted=preempted, wasted_gpu_hours=wasted / 3600,
    )
