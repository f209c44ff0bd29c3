"""Replay a slice of the Philly GPU trace through plain Dask (modelled), FIFO, EASY backfill and our policy.

    .venv/bin/python bench/simulate.py --start 2017-10-02 --end 2017-10-04 --hosts 8 --gpus 8 \
        --max-duration 86400 --long clip --tenants 10

Prints one row per policy: makespan, makespan / LB+, mean and p95 job
completion time (JCT), mean wait, GPU utilisation, Jain's fairness index and
the policy's p99 decision time. Jobs wider than one host are dropped (a run
needs its GPUs on one Dask worker); how many is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import csv
import json
import sys
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dask_gpu.queue_policy import EasyBackfill, FairShare, Fifo, Job, PlainDask  # noqa: E402
from aisched_prefect.simulator import Outcome, simulate  # noqa: E402

TRACE = next((p for p in (Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "philly.csv",
                          Path.cwd().parent / "shared" / "data" / "philly.csv") if p.exists()),
             Path("../shared/data/philly.csv"))


def _epoch(text: str) -> float:
    fmt = "%Y-%m-%d %H:%M:%S" if " " in text else "%Y-%m-%d"
    return datetime.strptime(text, fmt).replace(tzinfo=timezone.utc).timestamp()


def load(path: Path, start: str, end: str, gpus_per_host: int, max_duration: float | None, long: str,
         tenants: int | None) -> tuple[list[Job], dict[int, float], dict[str, int]]:
    lo, hi = _epoch(start), _epoch(end)
    rows = []
    dropped = Counter()
    with open(path) as f:
        for r in csv.DictReader(f):
            t = _epoch(r["timestamp"])
            if not lo <= t < hi:
                continue
            gpus, duration = int(r["num_gpus"]), float(r["duration"])
            if gpus > gpus_per_host:
                dropped["wider than a host"] += 1
                continue
            if duration <= 0:
                dropped["no duration"] += 1
                continue
            if max_duration is not None and duration > max_duration:
                if long == "drop":
                    dropped["longer than --max-duration"] += 1
                    continue
                duration = max_duration
            rows.append((t, r["cluster"], gpus, duration))
    if tenants is not None:
        work = Counter()
        for _, tenant, gpus, duration in rows:
            work[tenant] += gpus * duration
        keep = {t for t, _ in work.most_common(tenants)}
        dropped["not among the busiest tenants"] += sum(1 for r in rows if r[1] not in keep)
        rows = [r for r in rows if r[1] in keep]
    rows.sort()
    jobs = [Job(id=i, tenant=tenant, gpus=gpus, submit=t, estimate=duration) for i, (t, tenant, gpus, duration) in enumerate(rows)]
    return jobs, {j.id: j.estimate for j in jobs}, dict(dropped)


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--start", default="2017-10-02", help="submit window start (UTC date or 'date time')")
    p.add_argument("--end", default="2017-10-03", help="submit window end")
    p.add_argument("--hosts", type=int, default=8)
    p.add_argument("--gpus", type=int, default=8, help="GPUs per host")
    p.add_argument("--max-duration", type=float, default=None, help="seconds; longer jobs are clipped or dropped")
    p.add_argument("--long", choices=["clip", "drop"], default="clip")
    p.add_argument("--tenants", type=int, default=None, help="keep the N busiest tenants (by GPU-seconds)")
    p.add_argument("--preemptible", choices=["none", "restart", "resume"], default="none",
                   help="what-if: mark every job preemptible (the trace's jobs are not), so our policy may stop "
                        "borrowed runs to give a tenant its quota back; stopped runs restart from the beginning "
                        "(restart) or go on from where they stopped (resume: tasks that checkpoint)")
    p.add_argument("--json", action="store_true", help="one JSON object per policy instead of the table")
    p.add_argument("--plot", type=Path, default=None, help="write GPU utilisation and queue length over time (PNG)")
    args = p.parse_args()
    if not args.trace.exists():
        sys.exit(f"no trace at {args.trace}: pass --trace PATH to philly.csv")

    jobs, durations, dropped = load(args.trace, args.start, args.end, args.gpus, args.max_duration, args.long, args.tenants)
    if not jobs:
        sys.exit("no jobs in that slice: widen --start/--end")
    if args.preemptible != "none":
        jobs = [dataclasses.replace(j, preemptible=True) for j in jobs]
    capacity = args.hosts * args.gpus
    offered = sum(j.gpus * durations[j.id] for j in jobs) / (capacity * (_epoch(args.end) - _epoch(args.start)))
    policies = [PlainDask(args.hosts), Fifo(), EasyBackfill(), FairShare()]
    outcomes: list[Outcome] = [simulate(jobs, durations, policy, args.hosts, args.gpus,
                                        resume_preempted=args.preemptible == "resume") for policy in policies]
    if args.json:
        for o in outcomes:
            print(json.dumps({k: v for k, v in vars(o).items() if k != "timeline"} | {"makespan_ratio": o.makespan_ratio,
                                                                                       "offered_load": offered}))
    else:
        print(f"{len(jobs)} jobs, {len({j.tenant for j in jobs})} tenants, {args.hosts} hosts x {args.gpus} GPUs, "
              f"offered load {offered:.2f}; dropped: {dropped or 'none'}")
        print(f"{'policy':<14} {'makespan':>10} {'/LB+':>6} {'mean JCT':>10} {'p95 JCT':>10} {'mean wait':>10} "
              f"{'util':>6} {'Jain':>6} {'p99 decide':>11}")
        for o in outcomes:
            print(f"{o.policy:<14} {_hours(o.makespan):>10} {o.makespan_ratio:>6.3f} {_hours(o.mean_jct):>10} "
                  f"{_hours(o.p95_jct):>10} {_hours(o.mean_wait):>10} {o.utilization:>6.1%} {o.jain:>6.3f} "
                  f"{o.decision_p99_ms:>9.2f}ms")
        for o in outcomes:
            if o.preempted:
                print(f"{o.policy}: preempted {o.preempted} runs ({args.preemptible}), "
                      f"{o.wasted_gpu_hours:.1f} GPU-hours of their work lost")
    if args.plot:
        plot(outcomes, args.plot)


def plot(outcomes: list[Outcome], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("--plot needs matplotlib: .venv/bin/pip install -e '.[bench]'")
    fig, (util, queue) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for o in outcomes:
        xs = [t / 3600 for t, _, _ in o.timeline]
        util.step(xs, [b for _, b, _ in o.timeline], where="post", label=o.policy, linewidth=1)
        queue.step(xs, [q for _, _, q in o.timeline], where="post", label=o.policy, linewidth=1)
    util.set_ylabel("busy GPUs")
    queue.set_ylabel("jobs waiting")
    queue.set_xlabel("hours since the first submit")
    util.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
