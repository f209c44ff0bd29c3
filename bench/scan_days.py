"""Which days of the trace are busy: offered load per day on the simulated cluster (the scan that picks the slices).

    .venv/bin/python bench/scan_days.py --hosts 8 --gpus 8 --max-duration 21600 --long clip --tenants 10

Prints every day with jobs, its offered load (GPU-seconds asked / GPUs x the span from the day's first
submit to its end), jobs, gangs and tenants, and marks the busy ones (--low <= load <= --high).
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.trace import TRACE, load, offered_load  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--first", default="2017-10-01")
    p.add_argument("--last", default="2017-12-31")
    p.add_argument("--hosts", type=int, default=8)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--max-duration", type=float, default=21600)
    p.add_argument("--long", choices=["clip", "drop"], default="clip")
    p.add_argument("--tenants", type=int, default=10)
    p.add_argument("--low", type=float, default=1.2)
    p.add_argument("--high", type=float, default=1.5)
    args = p.parse_args()
    day = datetime.fromisoformat(args.first).replace(tzinfo=timezone.utc)
    last = datetime.fromisoformat(args.last).replace(tzinfo=timezone.utc)
    busy = []
    while day <= last:
        start, end = day.strftime("%Y-%m-%d"), (day + timedelta(days=1)).strftime("%Y-%m-%d")
        jobs, durations, _ = load(args.trace, start, end, args.hosts, args.gpus, args.max_duration, args.long, args.tenants)
        if jobs:
            load_ = offered_load(jobs, durations, args.hosts * args.gpus, end)
            mark = args.low <= load_ <= args.high
            busy += [start] if mark else []
            print(f"{start} load {load_:5.2f} jobs {len(jobs):5d} gangs {sum(j.gpus > args.gpus for j in jobs):3d} "
                  f"tenants {len({j.tenant for j in jobs}):2d}{'  busy' if mark else ''}")
        day += timedelta(days=1)
    print(f"busy ({args.low}-{args.high}): {len(busy)} days: {' '.join(busy)}")


if __name__ == "__main__":
    main()
