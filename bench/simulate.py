"""Replay a slice of the Philly GPU trace through plain Dask (modelled), FIFO, EASY backfill and our policy.

    .venv/bin/python bench/simulate.py --start 2017-10-22 --end 2017-10-23 --hosts 8 --gpus 8 \
        --max-duration 21600 --long clip --tenants 10

Prints one row per policy: makespan, makespan / LB+, mean and p95 job
completion time (JCT), mean wait, GPU utilisation, finish-time fairness (max
rho over tenants: a tenant's summed JCT here / alone under EASY on its private
pool of max(floor(H*G/N), its widest job) GPUs), min s_active (GPUs received
as a capped share of the max-min fair share over each tenant's active period),
Jain (information only) and the policy's p99 decision time (process CPU).
Jobs wider than one host run as gangs on whole hosts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.trace import TRACE, BadTime, load, offered_load  # noqa: E402
from dask_gpu.queue_policy import EasyBackfill, FinishTimeFair, Fifo, PlainDask, Policy  # noqa: E402
from dask_gpu.simulator import Outcome, alone, simulate  # noqa: E402


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h"


def run_slice(trace: Path, start: str, end: str, hosts: int, gpus: int, max_duration: float | None, long: str,
              tenants: int | None, preemptible: str = "none", ours: Policy | None = None,
              baselines: bool = True) -> tuple[list[Outcome], dict]:
    """Every policy's outcome on one slice (rho filled in) and the slice's facts (jobs, tenants, load, dropped)."""
    jobs, durations, dropped = load(trace, start, end, hosts, gpus, max_duration, long, tenants)
    if not jobs:
        raise SystemExit("no jobs in that slice: widen --start/--end")
    if preemptible != "none":
        jobs = [dataclasses.replace(j, preemptible=True) for j in jobs]
    pools = alone(jobs, durations, hosts, gpus)
    policies = [PlainDask(hosts), Fifo(), EasyBackfill()] if baselines else []
    policies.append(ours or FinishTimeFair())
    outcomes = [simulate(jobs, durations, p, hosts, gpus, resume_preempted=preemptible == "resume").with_alone(pools)
                for p in policies]
    facts = {"jobs": len(jobs), "tenants": len({j.tenant for j in jobs}), "gangs": sum(j.gpus > gpus for j in jobs),
             "offered_load": offered_load(jobs, durations, hosts * gpus, end), "dropped": dropped}
    return outcomes, facts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--start", default="2017-10-22", help="submit window start (UTC 'YYYY-MM-DD' or 'YYYY-MM-DD HH:MM')")
    p.add_argument("--end", default="2017-10-23", help="submit window end (same forms)")
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
    p.add_argument("--plot", type=Path, default=None, help="write the pictures (PNG): per-tenant running and "
                   "waiting GPUs per policy, JCT CDF, rho per tenant")
    args = p.parse_args(argv)
    if not args.trace.exists():
        sys.exit(f"no trace at {args.trace}: pass --trace PATH to philly.csv")
    try:
        outcomes, facts = run_slice(args.trace, args.start, args.end, args.hosts, args.gpus, args.max_duration,
                                    args.long, args.tenants, args.preemptible)
    except BadTime as e:
        p.error(f"--start/--end: {e}")
    if args.json:
        for o in outcomes:
            print(json.dumps({k: v for k, v in vars(o).items() if k not in ("timeline", "started", "ended", "jct")}
                             | {"makespan_ratio": o.makespan_ratio, "max_rho": o.max_rho,
                                "min_s_active": o.min_s_active} | facts))
    else:
        print(f"{facts['jobs']} jobs ({facts['gangs']} gangs), {facts['tenants']} tenants, {args.hosts} hosts x "
              f"{args.gpus} GPUs, offered load {facts['offered_load']:.2f}; left out: {facts['dropped'] or 'none'}")
        print(f"{'policy':<14} {'makespan':>10} {'/LB+':>6} {'mean JCT':>10} {'p95 JCT':>10} {'mean wait':>10} "
              f"{'util':>6} {'max rho':>8} {'min s_act':>9} {'Jain':>6} {'p99 CPU':>9}")
        for o in outcomes:
            print(f"{o.policy:<14} {_hours(o.makespan):>10} {o.makespan_ratio:>6.3f} {_hours(o.mean_jct):>10} "
                  f"{_hours(o.p95_jct):>10} {_hours(o.mean_wait):>10} {o.utilization:>6.1%} {o.max_rho:>8.3f} "
                  f"{o.min_s_active:>9.3f} {o.jain:>6.3f} {o.decision_p99_ms:>7.2f}ms")
        tenants = sorted(outcomes[0].rho)
        print("rho per tenant: " + " ".join(f"{t[:6]:>6}" for t in tenants))
        for o in outcomes:
            print(f"  {o.policy:<13} " + " ".join(f"{o.rho[t]:>6.2f}" for t in tenants))
        for o in outcomes:
            if o.preempted:
                print(f"{o.policy}: preempted {o.preempted} runs ({args.preemptible}), "
                      f"{o.wasted_gpu_hours:.1f} GPU-hours of their work lost")
    if args.plot:
        from bench.plots import draw

        command = "bench/simulate.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
        draw(outcomes, args.plot, f"{args.start} to {args.end}", facts, command)


if __name__ == "__main__":
    main()
