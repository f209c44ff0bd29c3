"""How long one FairShare decision takes with a long queue: p50 / p99 of `schedule` with N runs queued.

    .venv/bin/python bench/decision_speed.py --queued 10000

The queue is random (10 tenants, 1-8 GPUs, 1 min - 6 h estimates) on 8 hosts x 8 GPUs that are
nearly full; each decision follows one run ending (its GPUs come free) and a new run arriving,
as in a busy cluster, so the queue stays at N.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dask_gpu.queue_policy import ClusterState, FairShare, Job, Running  # noqa: E402


def measure(queued: int = 10_000, decisions: int = 500, hosts: int = 8, gpus: int = 8, seed: int = 1) -> tuple[float, float]:
    rng = random.Random(seed)
    policy = FairShare()
    state = ClusterState(free=[gpus] * hosts)
    ids = iter(range(10**9))

    def new(now: float) -> Job:
        return Job(id=next(ids), tenant=f"t{rng.randrange(10)}", gpus=rng.choice([1, 1, 1, 2, 4, 8]), submit=now,
                   estimate=rng.uniform(60, 6 * 3600))

    now = 0.0
    for h in range(hosts):  # a full cluster: one 8-GPU... or mixed runs per host
        left = gpus
        while left:
            g = min(left, rng.choice([1, 2, 4]))
            state.running.append(Running(new(now), h, now - rng.uniform(0, 3600)))
            left -= g
            state.free[h] = left
            state.running[-1] = Running(Job(id=state.running[-1].job.id, tenant=state.running[-1].job.tenant, gpus=g,
                                            submit=now, estimate=state.running[-1].job.estimate), h, state.running[-1].start)
    for _ in range(queued):
        policy.submit(new(now), state)
    times = []
    for _ in range(decisions):
        now += rng.uniform(1, 60)
        done = state.running.pop(rng.randrange(len(state.running)))  # one run ends
        state.free[done.host] += done.job.gpus
        policy.submit(new(now), state)
        t = time.perf_counter()
        starts = policy.schedule(now, state)
        times.append(time.perf_counter() - t)
        for s in starts:
            state.running.append(Running(s.job, s.host, now))
        while policy.waiting() < queued:
            policy.submit(new(now), state)
    times.sort()
    return 1000 * times[len(times) // 2], 1000 * times[min(len(times) - 1, int(0.99 * len(times)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queued", type=int, default=10_000)
    p.add_argument("--decisions", type=int, default=500)
    args = p.parse_args()
    p50, p99 = measure(args.queued, args.decisions)
    print(f"FairShare with {args.queued} runs queued, 8 hosts x 8 GPUs: decision p50 {p50:.2f} ms, p99 {p99:.2f} ms")


if __name__ == "__main__":
    main()
