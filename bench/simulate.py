"""Replay a slice of the Philly GPU trace through plain Dask (modelled), FIFO, EASY, three baselines and ours.

    .venv/bin/python bench/simulate.py --start 2017-10-22 --end 2017-10-23 --hosts 8 --gpus 8 \
        --max-duration 21600 --long clip --tenants 10 [--estimates user|oracle|none]

What the policies are told about each job's length is `--estimates` (`dask_gpu.sim.simulator.with_estimates`):
`user` (the default: rounded up to users' modal limits, a fraction asked far too long), `oracle` (the real
duration: a bound) or `none` (every job says the cluster's time limit). Jobs still run their real time.
Prints one row per policy: makespan, makespan / LB+, mean and p95 job
completion time (JCT), mean wait, GPU utilisation, finish-time fairness (max
rho over tenants: a tenant's summed JCT here / alone under EASY on its private
pool of max(floor(H*G/N), its widest job) GPUs, N = the tenants it contended
with on average while it had work, as Themis; `rho N=all`: N = every tenant
of the slice, the older, more lenient figure), min s_active (GPUs received
as a capped share of the max-min fair share over each tenant's active period),
Jain (information only) and the policy's p99 decision time (process CPU);
then ours against the best of the baselines on each figure.
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
from dask_gpu.sim.policies import (EasyBackfill, Fifo, Las2D, MaxMinFair, PlainDask, Policy,  # noqa: E402
                                   SjfEasy)
from dask_gpu.policies.config import PolicyConfig  # noqa: E402
from dask_gpu.policies.time_limits import TimeLimits  # noqa: E402
from dask_gpu.sim.simulator import ESTIMATES, LIVE_LIMITS, Outcome, _unit, simulate, with_estimates  # noqa: E402

BASELINES = ("easy-backfill", "sjf-easy", "las-2d", "max-min")  # what "best baseline" is taken over


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h"


def run_slice(trace: Path, start: str, end: str, hosts: int, gpus: int, max_duration: float | None, long: str,
              tenants: int | None, preemptible: str = "none", ours: Policy | None = None,
              baselines: bool = True, estimates: str = "user", models: bool = True, batch: bool = False,
              jitter: int | None = None, limits: TimeLimits | None = LIVE_LIMITS) -> tuple[list[Outcome], dict]:
    """Every policy's outcome on one slice (rho filled in) and the slice's facts (jobs, tenants, load, dropped).

    `baselines`: also EASY, SJF+EASY, 2D-LAS and max-min (else EASY and ours only); `models`: also the models of
    plain Dask and FIFO; `batch`: one pass per burst of simultaneous events (the live plugin's dispatch);
    `jitter` (a seed): a replay with a seeded 0-1 s added to every run time (estimates as for the trace); `limits`:
    every policy's runs stop at their time limits as the live control plane stops them (None: never)."""
    jobs, durations, dropped = load(trace, start, end, hosts, gpus, max_duration, long, tenants)
    if not jobs:
        raise SystemExit("no jobs in that slice: widen --start/--end")
    asked = durations  # what users ask is set by the trace's run times (the oracle knows the replay's)
    if jitter is not None:
        durations = {k: d + _unit(jitter, k) for k, d in durations.items()}
    jobs = with_estimates(jobs, durations if estimates == "oracle" else asked, estimates, limit=max_duration)
    if preemptible != "none":
        jobs = [dataclasses.replace(j, preemptible=True) for j in jobs]
    policies: list[Policy] = [PlainDask(hosts), Fifo()] if baselines and models else []
    policies += [EasyBackfill(), SjfEasy(), Las2D(), MaxMinFair()] if baselines else [EasyBackfill()]
    policies.append(ours or PolicyConfig().build())  # ours: the live configuration
    cache: dict = {}
    outcomes = [simulate(jobs, durations, p, hosts, gpus, resume_preempted=preemptible == "resume", batch=batch,
                         limits=limits)
                .with_fairness(jobs, durations, hosts, gpus, cache) for p in policies]
    facts = {"jobs": len(jobs), "tenants": len({j.tenant for j in jobs}), "gangs": sum(j.gpus > gpus for j in jobs),
             "offered_load": offered_load(jobs, durations, hosts * gpus, end), "dropped": dropped,
             "estimates": estimates}
    return outcomes, facts


def best_baseline(outcomes: list[Outcome]) -> dict[str, tuple[str, float]]:
    """Per figure (makespan, mean JCT, p95 JCT, max rho), the best baseline's name and value (lower is better)."""
    base = [o for o in outcomes if o.policy in BASELINES]
    out = {}
    for figure, value in (("makespan", lambda o: o.makespan), ("mean_jct", lambda o: o.mean_jct),
                          ("p95_jct", lambda o: o.p95_jct), ("max_rho", lambda o: o.max_rho)):
        best = min(base, key=value)
        out[figure] = (best.policy, value(best))
    return out


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
    p.add_argument("--estimates", choices=ESTIMATES, default="user",
                   help="what the policies are told of each job's length: users' rounded-up limits (user), the real "
                        "duration (oracle: a bound), nothing (none: every job says the --max-duration limit)")
    p.add_argument("--per-event", action="store_true", help="one scheduling pass per event (default: one per burst "
                   "of simultaneous events, as the live plugin dispatches)")
    p.add_argument("--json", action="store_true", help="one JSON object per policy instead of the table")
    p.add_argument("--plot", type=Path, default=None, help="write the pictures (PNG): per-tenant running and "
                   "waiting GPUs per policy, JCT CDF, rho per tenant")
    args = p.parse_args(argv)
    if not args.trace.exists():
        sys.exit(f"no trace at {args.trace}: pass --trace PATH to philly.csv")
    try:
        outcomes, facts = run_slice(args.trace, args.start, args.end, args.hosts, args.gpus, args.max_duration,
                                    args.long, args.tenants, args.preemptible, estimates=args.estimates,
                                    batch=not args.per_event)
    except BadTime as e:
        p.error(f"--start/--end: {e}")
    if args.json:
        for o in outcomes:
            print(json.dumps({k: v for k, v in vars(o).items() if k not in ("timeline", "started", "ended", "jct")}
                             | {"makespan_ratio": o.makespan_ratio, "max_rho": o.max_rho,
                                "max_rho_slice": o.max_rho_slice, "min_s_active": o.min_s_active} | facts))
    else:
        print(f"{facts['jobs']} jobs ({facts['gangs']} gangs), {facts['tenants']} tenants, {args.hosts} hosts x "
              f"{args.gpus} GPUs, offered load {facts['offered_load']:.2f}, estimates {args.estimates}; "
              f"left out: {facts['dropped'] or 'none'}")
        print(f"{'policy':<14} {'makespan':>10} {'/LB+':>6} {'mean JCT':>10} {'p95 JCT':>10} {'mean wait':>10} "
              f"{'util':>6} {'max rho':>8} {'rho N=all':>9} {'min s_act':>9} {'Jain':>6} {'p99 CPU':>9}")
        for o in outcomes:
            print(f"{o.policy:<14} {_hours(o.makespan):>10} {o.makespan_ratio:>6.3f} {_hours(o.mean_jct):>10} "
                  f"{_hours(o.p95_jct):>10} {_hours(o.mean_wait):>10} {o.utilization:>6.1%} {o.max_rho:>8.3f} "
                  f"{o.max_rho_slice:>9.3f} {o.min_s_active:>9.3f} {o.jain:>6.3f} {o.decision_p99_ms:>7.2f}ms")
        ours = outcomes[-1]
        best = best_baseline(outcomes)
        mine = {"makespan": ours.makespan, "mean_jct": ours.mean_jct, "p95_jct": ours.p95_jct, "max_rho": ours.max_rho}
        print("ours / best baseline: " + ", ".join(f"{k} {mine[k] / v:.3f} ({name})" for k, (name, v) in best.items()))
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
