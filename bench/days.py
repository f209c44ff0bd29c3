"""Every busy day at once: EASY, SJF+EASY, 2D-LAS, max-min and ours per day, with the issue's targets checked.

    .venv/bin/python bench/days.py                      # the 43 days (18 busy + 25 overloaded), user estimates
    .venv/bin/python bench/days.py --set busy --estimates oracle     # the docs' 18 days with perfect estimates
    .venv/bin/python bench/days.py --set tuning --ours behind=1.0    # a sweep point

Days: `busy`, the 18 with offered load 1.2-1.5 on 8 hosts x 8 GPUs, 10 busiest tenants, jobs clipped
at 6 h (`bench/scan_days.py`), split once, alternately in date order, into `tuning` and `held-out`;
`overloaded`, the 25 with offered load above 1.5 (`bench/scan_days.py --low 1.5 --high 1000`); `all`,
both. rho is Themis' (each tenant's pool from the contention it met). Targets per day: makespan <=
1.02x EASY's; mean JCT <= EASY's and <= 1.15x the best baseline's (EASY, SJF+EASY, 2D-LAS, max-min);
max rho <= 1.25.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.simulate import best_baseline, run_slice  # noqa: E402
from bench.trace import TRACE  # noqa: E402
from dask_gpu.queue_policy import FinishTimeFair  # noqa: E402
from dask_gpu.simulator import ESTIMATES  # noqa: E402

BUSY = ["2017-10-03", "2017-10-06", "2017-10-09", "2017-10-14", "2017-10-18", "2017-10-21", "2017-10-22",
        "2017-10-25", "2017-10-27", "2017-10-31", "2017-11-01", "2017-11-02", "2017-11-07", "2017-11-08",
        "2017-11-11", "2017-11-13", "2017-11-15", "2017-11-27"]
OVERLOADED = ["2017-10-02", "2017-10-04", "2017-10-05", "2017-10-08", "2017-10-10", "2017-10-11", "2017-10-12",
              "2017-10-13", "2017-10-16", "2017-10-17", "2017-10-19", "2017-10-20", "2017-10-23", "2017-10-24",
              "2017-10-26", "2017-11-09", "2017-11-10", "2017-11-16", "2017-11-17", "2017-11-21", "2017-11-22",
              "2017-11-28", "2017-11-30", "2017-12-05", "2017-12-08"]
SETS = {"tuning": BUSY[0::2], "held-out": BUSY[1::2], "busy": BUSY, "overloaded": OVERLOADED,
        "all": sorted(BUSY + OVERLOADED)}
COMMAND = ("bench/simulate.py --start {day} --end {next} --hosts 8 --gpus 8 --max-duration 21600 --long clip "
           "--tenants 10 --estimates {estimates}")
SHOWN = ("easy-backfill", "sjf-easy", "las-2d", "max-min", "ours")


def _value(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def targets(by: dict, best: dict) -> dict[str, bool]:
    """The issue's targets for ours on one day."""
    easy, ours = by["easy-backfill"], by["ours"]
    return {"makespan": ours.makespan <= 1.02 * easy.makespan,
            "jct": ours.mean_jct <= easy.mean_jct and ours.mean_jct <= 1.15 * best["mean_jct"][1],
            "rho": ours.max_rho <= 1.25}


def misses(by: dict, best: dict, met: dict[str, bool]) -> str:
    """What a day missed, in words (the table's last column)."""
    easy, ours = by["easy-backfill"], by["ours"]
    out = []
    if not met["makespan"]:
        out.append(f"makespan {ours.makespan / easy.makespan - 1:+.1%} vs EASY")
    if not met["jct"]:
        out.append(f"JCT {ours.mean_jct / easy.mean_jct:.2f}x EASY, {ours.mean_jct / best['mean_jct'][1]:.2f}x "
                   f"{best['mean_jct'][0]}")
    if not met["rho"]:
        out.append(f"rho {ours.max_rho:.2f}")
    return ", ".join(out) or "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", choices=list(SETS), default="all")
    p.add_argument("--days", nargs="*", help="these days instead of a set")
    p.add_argument("--estimates", choices=ESTIMATES, default="user")
    p.add_argument("--ours", nargs="*", default=[], help="FinishTimeFair settings, name=value")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    settings = {k: _value(v) for k, v in (a.split("=", 1) for a in args.ours)}
    rows = []
    if not args.json:
        print(f"estimates {args.estimates}; cells: makespan h / mean JCT h / p95 JCT h / max rho (Themis)")
        print("| day (load; jobs, gangs) | " + " | ".join(SHOWN) + " | ours / best baseline (mk, JCT, p95, rho) "
              "| missed |")
        print("|---" * (len(SHOWN) + 3) + "|")
    for day in args.days or SETS[args.set]:
        nxt = (datetime.fromisoformat(day) + timedelta(days=1)).strftime("%Y-%m-%d")
        outcomes, facts = run_slice(TRACE, day, nxt, 8, 8, 21600, "clip", 10, ours=FinishTimeFair(**settings),
                                    estimates=args.estimates, models=False)
        by = {o.policy: o for o in outcomes}
        best = best_baseline(outcomes)
        met = targets(by, best)
        ours = by["ours"]
        ratio = {"makespan": ours.makespan, "mean_jct": ours.mean_jct, "p95_jct": ours.p95_jct, "max_rho": ours.max_rho}
        ratio = {k: ratio[k] / v for k, (_, v) in best.items()}
        kind = "busy" if day in BUSY else "overloaded"
        row = {"day": day, "set": kind, **facts,
               **{o.policy: {"makespan_h": o.makespan / 3600, "mean_jct_h": o.mean_jct / 3600,
                             "p95_jct_h": o.p95_jct / 3600, "max_rho": o.max_rho, "max_rho_slice": o.max_rho_slice,
                             "p99_ms": o.decision_p99_ms} for o in outcomes},
               "best": {k: {"policy": n, "value": v} for k, (n, v) in best.items()}, "ours_over_best": ratio,
               "met": met}
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            cells = " | ".join(f"{by[k].makespan / 3600:.1f} / {by[k].mean_jct / 3600:.2f} / {by[k].p95_jct / 3600:.1f}"
                               f" / {by[k].max_rho:.2f}" for k in SHOWN)
            rel = " / ".join(f"{ratio[k]:.2f}" for k in ("makespan", "mean_jct", "p95_jct", "max_rho"))
            print(f"| {day} {kind} ({facts['offered_load']:.2f}; {facts['jobs']}, {facts['gangs']}) | {cells} | {rel} | "
                  f"{misses(by, best, met)} |", flush=True)
    n = len(rows)
    for kind in ("busy", "overloaded"):
        mine = [r for r in rows if r["set"] == kind]
        if mine:
            print(f"{kind}: all three targets on {sum(all(r['met'].values()) for r in mine)} of {len(mine)} days; "
                  f"makespan {sum(r['met']['makespan'] for r in mine)}, mean JCT {sum(r['met']['jct'] for r in mine)}, "
                  f"max rho {sum(r['met']['rho'] for r in mine)}")
    print(f"all three targets met on {sum(all(r['met'].values()) for r in rows)} of {n} days; "
          f"makespan {sum(r['met']['makespan'] for r in rows)}, mean JCT {sum(r['met']['jct'] for r in rows)}, "
          f"max rho {sum(r['met']['rho'] for r in rows)}; estimates {args.estimates}"
          + (f"; settings {settings}" if settings else ""))


if __name__ == "__main__":
    main()
