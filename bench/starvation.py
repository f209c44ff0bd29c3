"""The starvation bound's effect: ours with `starve_after` off and on, per day, on the median of 4 replays.

    .venv/bin/python bench/starvation.py --set busy                  # the bound at 1 h (starve_after=3600)
    .venv/bin/python bench/starvation.py --set overloaded --starve-after 7200

Same slices, replays and live configuration as `bench/days.py` (whose table gives the baselines' figures for
the same days: their runs do not depend on ours' settings). Per day, ours' makespan h / mean JCT h / max rho
(Themis) with the bound off and on, and the longest wait of any run of the day's light tenants (those with less
than 5 % of the day's GPU time): what the bound is for. One JSON line per day with `--json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.days import SETS, median  # noqa: E402
from bench.simulate import _unit, load, with_estimates  # noqa: E402
from bench.trace import TRACE  # noqa: E402
from dask_gpu.policies.config import PolicyConfig  # noqa: E402
from dask_gpu.sim.simulator import simulate  # noqa: E402

LIGHT = 0.05  # a tenant with less than this part of the day's GPU time is light


def day_figures(day: str, starve_after: float, replays: int) -> dict[str, list[float]]:
    """{"off": [...], "on": [...]}: medians over the replays of makespan h, mean JCT h, max rho, light tenants'
    longest wait h."""
    nxt = (datetime.fromisoformat(day) + timedelta(days=1)).strftime("%Y-%m-%d")
    jobs, asked, _ = load(TRACE, day, nxt, 8, 8, 21600, "clip", 10)
    jobs = with_estimates(jobs, asked, "user", limit=21600)  # users' estimates: those of the trace, every replay
    runs: dict[str, list[tuple[float, ...]]] = {"off": [], "on": []}
    for r in range(replays):
        durations = asked if r == 0 else {k: d + _unit(r, k) for k, d in asked.items()}
        work: dict[str, float] = {}
        for j in jobs:
            work[j.tenant] = work.get(j.tenant, 0.0) + j.gpus * durations[j.id]
        light = {t for t, w in work.items() if w < LIGHT * sum(work.values())}
        cache: dict = {}
        for name, settings in (("off", {}), ("on", {"starve_after": starve_after})):
            out = simulate(jobs, durations, PolicyConfig(**settings).build(), 8, 8, batch=True).with_fairness(
                jobs, durations, 8, 8, cache)
            wait = max((out.started[j.id] - j.submit for j in jobs if j.tenant in light), default=0.0)
            runs[name].append((out.makespan / 3600, out.mean_jct / 3600, out.max_rho, wait / 3600))
    return {name: [median([v[i] for v in vals]) for i in range(4)] for name, vals in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", choices=list(SETS), default="busy")
    p.add_argument("--days", nargs="*", help="these days instead of a set")
    p.add_argument("--starve-after", type=float, default=3600.0)
    p.add_argument("--replays", type=int, default=4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not args.json:
        print(f"starve_after={args.starve_after:g} s; median of {args.replays} replays; makespan h / mean JCT h / "
              "max rho, and light tenants' longest wait h")
        print("| day | bound off | bound on | light tenants' longest wait h (off -> on) |\n|---|---|---|---|")
    for day in args.days or SETS[args.set]:
        fig = day_figures(day, args.starve_after, args.replays)
        if args.json:
            print(json.dumps({"day": day, **fig}), flush=True)
        else:
            off, on = fig["off"], fig["on"]
            print(f"| {day} | {off[0]:.1f} / {off[1]:.2f} / {off[2]:.2f} | {on[0]:.1f} / {on[1]:.2f} / {on[2]:.2f} "
                  f"| {off[3]:.1f} -> {on[3]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
