"""Every busy day at once: EASY, SJF+EASY, 2D-LAS, max-min and ours per day, on the median of 4 replays, with
the targets checked per slice.

    .venv/bin/python bench/days.py                      # the 43 days (18 busy + 25 overloaded), user estimates
    .venv/bin/python bench/days.py --set busy --estimates oracle     # the docs' 18 days with perfect estimates
    .venv/bin/python bench/days.py --set tuning --ours behind=1.0    # a sweep point
    .venv/bin/python bench/days.py --replays 1                       # the trace as is only (faster)

Days: `busy`, the 18 with offered load 1.2-1.5 on 8 hosts x 8 GPUs, 10 busiest tenants, jobs clipped
at 6 h (`bench/scan_days.py`), split once, alternately in date order, into `tuning` and `held-out`;
`overloaded`, the 25 with offered load above 1.5 (`bench/scan_days.py --low 1.5 --high 1000`); `all`,
both. Ours runs the live configuration (`dask_gpu.policies.config.PolicyConfig`: the live plugin's half-life,
sharpness and time rules), and every policy is simulated with the live plugin's event batching (one pass per
burst of simultaneous events). Each figure is the median over `--replays` replays: the trace as is and copies
with a seeded 0-1 s added to every run time (a sub-second jitter moves single replays by several points).
rho is Themis' (each tenant's pool from the contention it met). Targets per slice: makespan <= 1.05x EASY's;
mean JCT <= 1.15x the best baseline's (EASY, SJF+EASY, 2D-LAS, max-min); max rho <= the larger of 1.25 and
the max rho the baselines' mean-JCT/max-rho trade-off reaches at ours' mean JCT (their Pareto frontier,
linear between its points, flat beyond its ends).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.simulate import BASELINES, run_slice  # noqa: E402
from bench.trace import TRACE  # noqa: E402
from dask_gpu.policies.config import PolicyConfig  # noqa: E402
from dask_gpu.sim.simulator import ESTIMATES  # noqa: E402

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


FIGURES = ("makespan", "mean_jct", "p95_jct", "max_rho")


def median(values: list[float]) -> float:
    """The median (of an even count: the mean of the middle two)."""
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def frontier_rho(points: list[tuple[float, float]], jct: float) -> float:
    """The max rho the baselines' (mean JCT, max rho) trade-off reaches at mean JCT `jct`: their Pareto frontier,
    linear between its points, flat beyond its ends.

    >>> frontier_rho([(1.0, 3.0), (2.0, 1.0), (3.0, 2.0)], 1.5), frontier_rho([(1.0, 3.0), (2.0, 1.0)], 0.5)
    (2.0, 3.0)
    """
    front: list[tuple[float, float]] = []
    for j, r in sorted(points):
        if not front or r < front[-1][1]:
            front.append((j, r))
    if jct <= front[0][0]:
        return front[0][1]
    for (j0, r0), (j1, r1) in zip(front, front[1:]):
        if jct <= j1:
            return r0 + (r1 - r0) * (jct - j0) / (j1 - j0)
    return front[-1][1]


def targets(by: dict[str, dict[str, float]]) -> tuple[dict[str, bool], dict[str, float]]:
    """The targets for ours on one slice (figures are medians over the replays), and the bounds they were held to."""
    ours, easy = by["ours"], by["easy-backfill"]
    base = {k: by[k] for k in BASELINES}
    best_jct = min(v["mean_jct"] for v in base.values())
    rho_bound = max(1.25, frontier_rho([(v["mean_jct"], v["max_rho"]) for v in base.values()], ours["mean_jct"]))
    bounds = {"makespan": 1.05 * easy["makespan"], "mean_jct": 1.15 * best_jct, "max_rho": rho_bound}
    return {k: ours[k] <= bounds[k] for k in bounds}, bounds


def misses(by: dict, met: dict[str, bool], bounds: dict[str, float]) -> str:
    """What a slice missed, in words (the table's last column)."""
    ours, out = by["ours"], []
    if not met["makespan"]:
        out.append(f"makespan {ours['makespan'] / by['easy-backfill']['makespan'] - 1:+.1%} vs EASY")
    if not met["mean_jct"]:
        out.append(f"JCT {ours['mean_jct'] / bounds['mean_jct'] * 1.15:.2f}x best")
    if not met["max_rho"]:
        out.append(f"rho {ours['max_rho']:.2f} > {bounds['max_rho']:.2f}")
    return ", ".join(out) or "-"


def replayed(day: str, nxt: str, config: PolicyConfig, estimates: str, replays: int,
             batch: bool | None = None) -> tuple[dict, dict]:
    """Per policy, the median of each figure over the replays (the trace as is, then jitter seeds 1, 2, ...);
    `batch`: one pass per burst (True) or per event (False); None: as the configuration says (the live plugin)."""
    runs: dict[str, dict[str, list[float]]] = {}
    facts: dict = {}
    for r in range(replays):
        outcomes, facts = run_slice(TRACE, day, nxt, 8, 8, 21600, "clip", 10, ours=config.build(),
                                    estimates=estimates, models=False,
                                    batch=config.batch_events if batch is None else batch,
                                    jitter=None if r == 0 else r, limits=config.limits())
        for o in outcomes:
            mine = runs.setdefault(o.policy, {f: [] for f in (*FIGURES, "p99_ms")})
            for f, v in (("makespan", o.makespan), ("mean_jct", o.mean_jct), ("p95_jct", o.p95_jct),
                         ("max_rho", o.max_rho), ("p99_ms", o.decision_p99_ms)):
                mine[f].append(v)
    return {p: {f: median(v) for f, v in figs.items()} for p, figs in runs.items()}, facts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", choices=list(SETS), default="all")
    p.add_argument("--days", nargs="*", help="these days instead of a set")
    p.add_argument("--estimates", choices=ESTIMATES, default="user")
    p.add_argument("--replays", type=int, default=4, help="the trace as is and N-1 jittered copies; medians")
    p.add_argument("--ours", nargs="*", default=[], help="settings on top of the live configuration, name=value")
    p.add_argument("--events", choices=["live", "burst", "event", "both"], default="live",
                   help="when a pass runs, for every policy alike: as the live plugin (the configuration's "
                   "batch_events), once per burst of simultaneous events, once per event, or both side by side "
                   "(each day twice; a row per event model, and a summary of each)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    settings = {k: _value(v) for k, v in (a.split("=", 1) for a in args.ours)}
    config = PolicyConfig(**settings)
    rows = []
    if not args.json:
        print(f"estimates {args.estimates}; median of {args.replays} replays; cells: makespan h / mean JCT h / "
              f"p95 JCT h / max rho (Themis); live configuration{f' with {settings}' if settings else ''}")
        print("| day (load; jobs, gangs) | " + " | ".join(SHOWN) + " | bounds: makespan h, JCT h, rho | targets "
              "(mk, JCT, rho) | missed |")
        print("|---" * (len(SHOWN) + 4) + "|")
    models = {"live": [None], "burst": [True], "event": [False], "both": [True, False]}[args.events]
    for day in args.days or SETS[args.set]:
        nxt = (datetime.fromisoformat(day) + timedelta(days=1)).strftime("%Y-%m-%d")
        for batch in models:
            rows.append(_day(day, nxt, config, args, batch))
    for batch in models:
        label = "" if batch is None else ("per burst: " if batch else "per event: ")
        mine = [r for r in rows if r["batch"] == batch]
        for kind in ("busy", "overloaded"):
            some = [r for r in mine if r["set"] == kind]
            if some:
                print(label + _summary(kind, some))
        print(label + _summary("all", mine) + f"; estimates {args.estimates}; {args.replays} replays"
              + (f"; settings {settings}" if settings else ""))
        if batch is not None:
            shift = [r["easy-backfill"]["makespan_h"] for r in mine]
            print(f"{label}EASY's makespan (the anchor), h: " + " ".join(f"{x:.1f}" for x in shift))


def _day(day: str, nxt: str, config: PolicyConfig, args: argparse.Namespace, batch: bool | None) -> dict:
    """One day's row (printed as it comes), under one event model."""
    by, facts = replayed(day, nxt, config, args.estimates, args.replays, batch)
    met, bounds = targets(by)
    kind = "busy" if day in BUSY else "overloaded"
    row = {"day": day, "set": kind, **facts, "replays": args.replays, "batch": batch,
           **{k: {"makespan_h": v["makespan"] / 3600, "mean_jct_h": v["mean_jct"] / 3600,
                  "p95_jct_h": v["p95_jct"] / 3600, "max_rho": v["max_rho"], "p99_ms": v["p99_ms"]}
              for k, v in by.items()},
           "bounds": {"makespan_h": bounds["makespan"] / 3600, "mean_jct_h": bounds["mean_jct"] / 3600,
                      "max_rho": bounds["max_rho"]}, "met": met}
    if args.json:
        print(json.dumps(row), flush=True)
    else:
        cells = " | ".join(f"{by[k]['makespan'] / 3600:.1f} / {by[k]['mean_jct'] / 3600:.2f} / "
                           f"{by[k]['p95_jct'] / 3600:.1f} / {by[k]['max_rho']:.2f}" for k in SHOWN)
        bound = f"{bounds['makespan'] / 3600:.1f}, {bounds['mean_jct'] / 3600:.2f}, {bounds['max_rho']:.2f}"
        held = " ".join("yes" if met[k] else "NO" for k in ("makespan", "mean_jct", "max_rho"))
        events = "" if batch is None else (" per burst" if batch else " per event")
        print(f"| {day} {kind}{events} ({facts['offered_load']:.2f}; {facts['jobs']}, {facts['gangs']}) | {cells} | "
              f"{bound} | {held} | {misses(by, met, bounds)} |", flush=True)
    return row


def _summary(kind: str, rows: list[dict]) -> str:
    return (f"{kind}: all three targets on {sum(all(r['met'].values()) for r in rows)} of {len(rows)} days; "
            f"makespan {sum(r['met']['makespan'] for r in rows)}, mean JCT {sum(r['met']['mean_jct'] for r in rows)}, "
            f"max rho {sum(r['met']['max_rho'] for r in rows)}")


if __name__ == "__main__":
    main()
