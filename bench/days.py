"""Every busy day at once: plain Dask, FIFO, EASY and ours per day, with the issue's targets checked.

    .venv/bin/python bench/days.py                 # all 18 busy days (bench/scan_days.py), the README table
    .venv/bin/python bench/days.py --set tuning --ours aging=7200 --no-baselines   # a sweep point

Busy days: offered load 1.2-1.5 on 8 hosts x 8 GPUs, 10 busiest tenants, jobs clipped at 6 h
(`bench/scan_days.py`). They are split once, alternately in date order, into days used while
tuning the policy and days never used for it. Targets per day, all three together: makespan <=
1.02x EASY's, mean JCT <= EASY's, max rho <= 1.25.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.simulate import run_slice  # noqa: E402
from bench.trace import TRACE  # noqa: E402
from dask_gpu.queue_policy import FinishTimeFair  # noqa: E402

BUSY = ["2017-10-03", "2017-10-06", "2017-10-09", "2017-10-14", "2017-10-18", "2017-10-21", "2017-10-22",
        "2017-10-25", "2017-10-27", "2017-10-31", "2017-11-01", "2017-11-02", "2017-11-07", "2017-11-08",
        "2017-11-11", "2017-11-13", "2017-11-15", "2017-11-27"]
SETS = {"tuning": BUSY[0::2], "held-out": BUSY[1::2], "all": BUSY}
COMMAND = ("bench/simulate.py --start {day} --end {next} --hosts 8 --gpus 8 --max-duration 21600 --long clip "
           "--tenants 10")


def _value(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", choices=list(SETS), default="all")
    p.add_argument("--days", nargs="*", help="these days instead of a set")
    p.add_argument("--ours", nargs="*", default=[], help="FinishTimeFair settings, name=value")
    p.add_argument("--no-baselines", action="store_true", help="ours only (EASY still runs: the targets need it)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    settings = {k: _value(v) for k, v in (a.split("=", 1) for a in args.ours)}
    met_all = 0
    rows = []
    for day in args.days or SETS[args.set]:
        nxt = (datetime.fromisoformat(day) + timedelta(days=1)).strftime("%Y-%m-%d")
        outcomes, facts = run_slice(TRACE, day, nxt, 8, 8, 21600, "clip", 10, ours=FinishTimeFair(**settings),
                                    baselines=not args.no_baselines)
        if args.no_baselines:
            from dask_gpu.queue_policy import EasyBackfill

            outcomes = [*run_slice(TRACE, day, nxt, 8, 8, 21600, "clip", 10, ours=EasyBackfill(), baselines=False)[0],
                        *outcomes]
        by = {o.policy: o for o in outcomes}
        easy, ours = by["easy-backfill"], by["ours"]
        met = (ours.makespan <= 1.02 * easy.makespan, ours.mean_jct <= easy.mean_jct, ours.max_rho <= 1.25)
        met_all += all(met)
        row = {"day": day, "set": "tuning" if day in SETS["tuning"] else "held-out", **facts,
               **{o.policy: {"makespan_h": o.makespan / 3600, "mean_jct_h": o.mean_jct / 3600, "max_rho": o.max_rho,
                             "min_s_active": o.min_s_active, "p99_ms": o.decision_p99_ms} for o in outcomes},
               "met": met}
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            cells = " | ".join(f"{by[k].makespan / 3600:.2f} / {by[k].mean_jct / 3600:.2f} / {by[k].max_rho:.2f}"
                               for k in ("plain-dask", "fifo", "easy-backfill", "ours") if k in by)
            marks = "".join("+" if m else "-" for m in met)
            print(f"| {day} ({facts['offered_load']:.2f}, {facts['gangs']} gangs) {row['set']} | {cells} | {marks} |",
                  flush=True)
    print(f"all three targets met on {met_all} of {len(rows)} days; makespan {sum(r['met'][0] for r in rows)}, "
          f"mean JCT {sum(r['met'][1] for r in rows)}, max rho {sum(r['met'][2] for r in rows)}"
          + (f"; settings {settings}" if settings else ""))


if __name__ == "__main__":
    main()
