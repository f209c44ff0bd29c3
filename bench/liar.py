"""One tenant under-declares: does it gain, and what do the others pay? Ours with and without estimate correction.

    .venv/bin/python bench/liar.py --days 2017-10-22 2017-11-08      # the liar: the slice's tenant with most jobs
    .venv/bin/python bench/liar.py --set busy --declare 900

Per slice (as bench/days.py: 8 hosts x 8 GPUs, 10 busiest tenants, jobs clipped at 6 h, user estimates), ours
(the live configuration, `PolicyConfig`, with the live event batching) runs the slice as is (honest) and with one tenant declaring `--declare` seconds for every job (its jobs still run
their real time). Printed: the honest tenants' mean JCT with the liar / without (target <= 1.05) and the liar's mean
JCT lying / honest (target >= 1: lying gains nothing), for ours as it is (estimates corrected from each tenant's
history, `dask_gpu.policies.estimates`) and for ours planning on declared estimates (the previous behaviour).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.days import SETS  # noqa: E402
from bench.trace import TRACE, load  # noqa: E402
from dask_gpu.policies.config import PolicyConfig  # noqa: E402
from dask_gpu.simulator import simulate, with_estimates  # noqa: E402


def mean_jct(outcome, jobs, keep) -> float:
    values = [c for j, c in zip(jobs, outcome.jct) if keep(j.tenant)]
    return sum(values) / len(values)


def liar_day(day: str, declare: float, correct: bool, liar: str | None = None) -> dict:
    """The liar experiment on one day: honest ratio and liar ratio (see the module's docstring)."""
    nxt = (datetime.fromisoformat(day) + timedelta(days=1)).strftime("%Y-%m-%d")
    jobs, durations, _ = load(TRACE, day, nxt, 8, 8, 21600, "clip", 10)
    jobs = with_estimates(jobs, durations, "user")
    liar = liar or Counter(j.tenant for j in jobs).most_common(1)[0][0]
    lying = [dataclasses.replace(j, estimate=declare) if j.tenant == liar else j for j in jobs]
    config = PolicyConfig(correct_estimates=correct)  # the live configuration, with or without the correction
    honest_run = simulate(jobs, durations, config.build(), 8, 8, batch=config.batch_events)
    lying_run = simulate(lying, durations, config.build(), 8, 8, batch=config.batch_events)
    others = lambda t: t != liar  # noqa: E731
    mine = lambda t: t == liar  # noqa: E731
    return {"day": day, "liar": liar, "liar_jobs": sum(j.tenant == liar for j in jobs), "jobs": len(jobs),
            "others": mean_jct(lying_run, lying, others) / mean_jct(honest_run, jobs, others),
            "liar_ratio": mean_jct(lying_run, lying, mine) / mean_jct(honest_run, jobs, mine),
            "liar_h": (mean_jct(honest_run, jobs, mine) / 3600, mean_jct(lying_run, lying, mine) / 3600)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", choices=list(SETS), default="tuning")
    p.add_argument("--days", nargs="*")
    p.add_argument("--declare", type=float, default=900.0, help="seconds the liar declares for every job")
    args = p.parse_args()
    print(f"liar declares {args.declare:.0f} s for every job; others: honest tenants' mean JCT with / without the "
          f"liar (<= 1.05); liar: its mean JCT lying / honest (>= 1)")
    print("| day | liar (jobs of all) | corrected: others | corrected: liar (h honest -> lying) | declared: others "
          "| declared: liar (h) | targets (corrected) |")
    print("|---|---|---|---|---|---|---|")
    held = 0
    days = args.days or SETS[args.set]
    for day in days:
        ours = liar_day(day, args.declare, True)
        old = liar_day(day, args.declare, False, ours["liar"])
        ok = ours["others"] <= 1.05 and ours["liar_ratio"] >= 1.0
        held += ok
        print(f"| {day} | {ours['liar'][:8]} ({ours['liar_jobs']} of {ours['jobs']}) | {ours['others']:.3f} | "
              f"{ours['liar_ratio']:.2f} ({ours['liar_h'][0]:.2f} -> {ours['liar_h'][1]:.2f}) | {old['others']:.3f} | "
              f"{old['liar_ratio']:.2f} ({old['liar_h'][0]:.2f} -> {old['liar_h'][1]:.2f}) | "
              f"{'both' if ok else 'missed'} |", flush=True)
    print(f"both liar targets held on {held} of {len(days)} days")


if __name__ == "__main__":
    main()
