"""How long one decision of our policy takes with a long queue: p50 / p99 CPU time of `submit` + `schedule` with N queued.

    .venv/bin/python bench/decision_speed.py --queued 10000          # ours in the live configuration
    .venv/bin/python bench/decision_speed.py --queued 100000
    .venv/bin/python bench/decision_speed.py --policy EasyBackfill   # another policy, its defaults

The queue is random (10 tenants, 1-8 GPUs and some 16-GPU gangs, 1 min - 6 h estimates) on 8 hosts x
8 GPUs that are nearly full; each decision follows one run ending (its GPUs come free) and a new run
arriving, as in a busy cluster, so the queue stays at N. A decision is what the live queue does for
that message: `submit` of the new run, then `schedule`; both are timed, and printed apart too. Ours
(`--policy live`, the default) is the live plugin's policy as `PolicyConfig()` builds it (its half-life,
sharpness, time rules, estimate correction), told each run's end time as the plugin does. Times
are process CPU time (`time.process_time`), so other load on the machine does not count. Targets:
p99 of the whole decision <= 5 ms at 10,000 queued, <= 10 ms at 100,000; printed as ratios to them.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dask_gpu.sim import policies as queue_policy  # noqa: E402
from dask_gpu.policies.config import PolicyConfig  # noqa: E402
from dask_gpu.sim.policies import ClusterState, Job, Running  # noqa: E402
from dask_gpu.sim.metrics import percentile  # noqa: E402

TARGET_MS = {10_000: 5.0, 100_000: 10.0}


def measure(queued: int = 10_000, decisions: int = 500, hosts: int = 8, gpus: int = 8, seed: int = 1,
            policy: str = "live") -> dict[str, tuple[float, float]]:
    """p50 and p99 (ms) of `submit`, of `schedule` and of the two together (one decision)."""
    rng = random.Random(seed)
    ours = PolicyConfig().build() if policy == "live" else getattr(queue_policy, policy)()
    state = ClusterState(free=[gpus] * hosts)
    ids = iter(range(10**9))

    def new(now: float, width: int | None = None) -> Job:
        return Job(id=next(ids), tenant=f"t{rng.randrange(10)}", gpus=width or rng.choice([1, 1, 1, 2, 4, 8, 16]),
                   submit=now, estimate=rng.uniform(60, 6 * 3600))

    now = 0.0
    for h in range(hosts):  # a full cluster of 1-4 GPU runs
        left = gpus
        while left:
            g = min(left, rng.choice([1, 2, 4]))
            state.running.append(Running(new(now, g), h, now - rng.uniform(0, 3600)))
            left -= g
        state.free[h] = 0
    for _ in range(queued):
        ours.submit(new(now), state)
    times: dict[str, list[float]] = {"submit": [], "schedule": [], "decision": []}
    for _ in range(decisions):
        now += rng.uniform(1, 60)
        done = state.running[rng.randrange(len(state.running))]  # one run ends
        state.release(done)
        ours.finish([done.job], now)  # when it ended, as the plugin tells it
        arriving = new(now)
        t = time.process_time()
        ours.submit(arriving, state)
        t1 = time.process_time()
        starts = ours.schedule(now, state)
        t2 = time.process_time()
        times["submit"].append(t1 - t)
        times["schedule"].append(t2 - t1)
        times["decision"].append(t2 - t)
        for s in starts:
            state.running.append(Running(s.job, s.host, now, s.gang))
        while ours.waiting() < queued:
            ours.submit(new(now), state)
    return {k: (1000 * percentile(v, 50), 1000 * percentile(v, 99)) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queued", type=int, default=10_000)
    p.add_argument("--decisions", type=int, default=500)
    p.add_argument("--policy", default="live", help="live (ours as the plugin runs it) or a class of queue_policy")
    args = p.parse_args()
    out = measure(args.queued, args.decisions, policy=args.policy)
    p50, p99 = out["decision"]
    target = TARGET_MS.get(args.queued)
    ratio = f", {p99 / target:.2f}x the {target:g} ms target" if target else ""
    print(f"{args.policy} with {args.queued} runs queued, 8 hosts x 8 GPUs: decision (submit + schedule) CPU "
          f"p50 {p50:.2f} ms, p99 {p99:.2f} ms{ratio}; submit p50 {out['submit'][0]:.3f} ms, p99 "
          f"{out['submit'][1]:.3f} ms; schedule p50 {out['schedule'][0]:.2f} ms, p99 {out['schedule'][1]:.2f} ms")


if __name__ == "__main__":
    main()
