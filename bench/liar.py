"""One tenant under-declares: does it gain, and what do the others pay? With time limits, as live.

    .venv/bin/python bench/liar.py --set all                         # the 43 days: a quarter, and no limit
    .venv/bin/python bench/liar.py --days 2017-10-22 2017-11-08      # the liar: the slice's tenant with most jobs
    .venv/bin/python bench/liar.py --set busy --declare 900          # every liar job declares 900 s

Per slice (as bench/days.py: 8 hosts x 8 GPUs, 10 busiest tenants, jobs clipped at 6 h, user estimates), ours
(the live configuration, `PolicyConfig`, its time limits and the live event batching) runs the slice as is
(honest) and with one tenant declaring a quarter of every estimate (`--declare quarter`, or N seconds), two ways:

- **limit**: its declared time is its limit, as every run's is by default: a run past it plus the grace is
  stopped; the liar's runs checkpoint and are requeued (`requeue_on_time_limit=True`), its best case: a run goes on
  from where it stopped, each piece waiting in the queue again;
- **no limit**: it declares `time_limit=None`: its runs are never stopped, are planned on its tenant's worst
  observed overrun factor, and their overrun is charged in rho at the premium.

Its jobs still run their real time. Printed: the honest tenants' mean JCT with the liar / without (target <= 1.05)
and the liar's mean JCT lying / honest (target >= 1: lying gains nothing), for each way.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.days import SETS, _value  # noqa: E402
from bench.trace import TRACE, load  # noqa: E402
from dask_gpu.policies.config import PolicyConfig  # noqa: E402
from dask_gpu.sim.simulator import simulate, with_estimates  # noqa: E402


def mean_jct(outcome, jobs, keep) -> float:
    values = [c for j, c in zip(jobs, outcome.jct) if keep(j.tenant)]
    return sum(values) / len(values)


def declared(job, declare: str) -> float:
    """What the liar declares for `job`: a quarter of its honest estimate, or a fixed number of seconds."""
    return job.estimate / 4 if declare == "quarter" else float(declare)


def liar_day(day: str, declare: str, liar: str | None = None, settings: dict | None = None) -> dict:
    """The liar experiment on one day, both ways (see the module's docstring): honest ratio and liar ratio."""
    nxt = (datetime.fromisoformat(day) + timedelta(days=1)).strftime("%Y-%m-%d")
    jobs, durations, _ = load(TRACE, day, nxt, 8, 8, 21600, "clip", 10)
    jobs = with_estimates(jobs, durations, "user")
    liar = liar or Counter(j.tenant for j in jobs).most_common(1)[0][0]
    config = PolicyConfig(**(settings or {}))  # the live configuration, its time limits included
    limits = config.limits()
    honest_run = simulate(jobs, durations, config.build(), 8, 8, batch=config.batch_events, limits=limits)
    others = lambda t: t != liar  # noqa: E731
    mine = lambda t: t == liar  # noqa: E731
    out = {"day": day, "liar": liar, "liar_jobs": sum(j.tenant == liar for j in jobs), "jobs": len(jobs)}
    for way, flags in (("limit", {"requeue": True}), ("no_limit", {"no_limit": True})):
        lying = [dataclasses.replace(j, estimate=declared(j, declare), **flags) if j.tenant == liar else j
                 for j in jobs]
        run = simulate(lying, durations, config.build(), 8, 8, batch=config.batch_events, limits=limits)
        out[way] = {"others": mean_jct(run, lying, others) / mean_jct(honest_run, jobs, others),
                    "liar_ratio": mean_jct(run, lying, mine) / mean_jct(honest_run, jobs, mine),
                    "liar_h": (mean_jct(honest_run, jobs, mine) / 3600, mean_jct(run, lying, mine) / 3600),
                    "requeued": run.requeued}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", choices=list(SETS), default="tuning")
    p.add_argument("--days", nargs="*")
    p.add_argument("--declare", default="quarter", help="what the liar declares: 'quarter' (of each estimate) or "
                   "seconds for every job")
    p.add_argument("--ours", nargs="*", default=[], help="settings on top of the live configuration, name=value")
    args = p.parse_args()
    settings = {k: _value(v) for k, v in (a.split("=", 1) for a in args.ours)}
    if args.declare != "quarter":
        try:
            float(args.declare)
        except ValueError:
            p.error(f"--declare: 'quarter' or seconds, not {args.declare!r}")
    print(f"liar declares {args.declare} {'of each estimate' if args.declare == 'quarter' else 's for every job'}; "
          "others: honest tenants' mean JCT with / without the liar (<= 1.05); liar: its mean JCT lying / honest "
          "(>= 1); limit: its runs stop at their limit and are requeued from their checkpoint; no limit: "
          "time_limit=None")
    print("| day | liar (jobs of all) | limit: others | limit: liar (h honest -> lying; requeued) | no limit: others "
          "| no limit: liar (h) | targets (limit; no limit) |")
    print("|---|---|---|---|---|---|---|")
    days = args.days or SETS[args.set]
    held = {"limit": [0, 0], "no_limit": [0, 0]}
    for day in days:
        r = liar_day(day, args.declare, settings=settings)
        words = []
        for way in ("limit", "no_limit"):
            ok = (r[way]["others"] <= 1.05, r[way]["liar_ratio"] >= 1.0)
            held[way][0] += ok[0]
            held[way][1] += ok[1]
            words.append("both" if all(ok) else "liar no better only" if ok[1] else "others within only" if ok[0] else "neither")
        lim, nol = r["limit"], r["no_limit"]
        print(f"| {day} | {r['liar'][:8]} ({r['liar_jobs']} of {r['jobs']}) | {lim['others']:.3f} | "
              f"{lim['liar_ratio']:.2f} ({lim['liar_h'][0]:.2f} -> {lim['liar_h'][1]:.2f}; {lim['requeued']}) | "
              f"{nol['others']:.3f} | {nol['liar_ratio']:.2f} ({nol['liar_h'][0]:.2f} -> {nol['liar_h'][1]:.2f}) | "
              f"{'; '.join(words)} |", flush=True)
    for way, (others, liar) in held.items():
        print(f"{way.replace('_', ' ')}: honest tenants within 5 % on {others} of {len(days)} days; the liar no "
              f"better on {liar} of {len(days)}")


if __name__ == "__main__":
    main()
