"""The scan over our policy's settings: each setting on the busy days, against EASY, and the Pareto front.

    .venv/bin/python bench/sweep.py --set tuning --grid stretch=1.1,1.2,1.4 urgency=0,0.5,1

For each combination of the settings in --grid: on each day, makespan / EASY's, mean JCT / EASY's
and max rho, and the number of days where each target holds (makespan <= 1.02x EASY, mean JCT <=
EASY, max rho <= 1.25). EASY's outcome and the private-pool sums (rho's denominators) do not depend
on our settings and are computed once per day per process.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.days import SETS, _value  # noqa: E402
from bench.trace import TRACE, load  # noqa: E402
from dask_gpu.sim import policies as queue_policy  # noqa: E402
from dask_gpu.sim.policies import EasyBackfill  # noqa: E402
from dask_gpu.sim.simulator import alone, simulate  # noqa: E402

_DAYS: dict[str, tuple] = {}


def day_data(day: str) -> tuple:
    if day not in _DAYS:
        nxt = (datetime.fromisoformat(day) + timedelta(days=1)).strftime("%Y-%m-%d")
        jobs, durations, _ = load(TRACE, day, nxt, 8, 8, 21600, "clip", 10)
        easy = simulate(jobs, durations, EasyBackfill(), 8, 8)
        _DAYS[day] = (jobs, durations, alone(jobs, durations, 8, 8), easy.makespan, easy.mean_jct)
    return _DAYS[day]


def point(policy: str, settings: dict, days: list[str]) -> dict:
    rows = []
    for day in days:
        jobs, durations, pools, easy_makespan, easy_jct = day_data(day)
        o = simulate(jobs, durations, getattr(queue_policy, policy)(**settings), 8, 8).with_alone(pools)
        rows.append({"day": day, "makespan": o.makespan / easy_makespan, "jct": o.mean_jct / easy_jct,
                     "rho": o.max_rho, "p99_ms": o.decision_p99_ms})
    return {"policy": policy, "settings": settings, "rows": rows,
            "makespan_ok": sum(r["makespan"] <= 1.02 for r in rows), "jct_ok": sum(r["jct"] <= 1.0 for r in rows),
            "rho_ok": sum(r["rho"] <= 1.25 for r in rows),
            "all_ok": sum(r["makespan"] <= 1.02 and r["jct"] <= 1.0 and r["rho"] <= 1.25 for r in rows),
            "worst": {"makespan": max(r["makespan"] for r in rows), "jct": max(r["jct"] for r in rows),
                      "rho": max(r["rho"] for r in rows)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", choices=list(SETS), default="tuning")
    p.add_argument("--days", nargs="*")
    p.add_argument("--policy", default="FinishTimeFair")
    p.add_argument("--grid", nargs="*", default=[], help="name=v1,v2,... (every combination is run)")
    p.add_argument("--out", type=Path, help="append one JSON line per point")
    args = p.parse_args()
    names = [g.split("=", 1)[0] for g in args.grid]
    values = [[_value(v) for v in g.split("=", 1)[1].split(",")] for g in args.grid]
    for combo in itertools.product(*values):
        settings = dict(zip(names, combo))
        r = point(args.policy, settings, args.days or SETS[args.set])
        w = r["worst"]
        print(f"{settings}: all {r['all_ok']}/{len(r['rows'])}  makespan {r['makespan_ok']} jct {r['jct_ok']} "
              f"rho {r['rho_ok']}  worst makespan x{w['makespan']:.3f} jct x{w['jct']:.3f} rho {w['rho']:.2f}  | "
              + " ".join(f"{x['day'][5:]}:{x['makespan']:.3f}/{x['jct']:.2f}/{x['rho']:.2f}" for x in r["rows"]),
              flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
