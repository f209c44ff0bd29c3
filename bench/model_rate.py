"""Does a model-call limit hold its rate? A .map() burst of model calls through the control plane, timed.

One flow run maps N calls of an `@ai_task(kind="model-call")` whose model has
`ModelLimit(per_minute=R)` in the applied ClusterBlock. The control plane
(`aisched serve --declared ...`, its own process, with its own local GPU
cluster) takes a slot for each call from the scheduler's model-limits plugin
(`dask_gpu.scheduler.limits`) and starts the body at its slot. Prints the slot spacing
(from the settlements), the rate of the bodies' starts over the whole burst,
and the starts in every 60 s window (the target: within 5 % of R, with no
bursts), against the R configured.

    .venv/bin/python bench/model_rate.py --calls 150 --per-minute 120
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def _call(i: int) -> float:
    start = time.time()
    time.sleep(0.05)
    return start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=150)
    p.add_argument("--per-minute", type=float, default=120.0)
    p.add_argument("--max-workers", type=int, default=16, help="calls the flow keeps in flight")
    args = p.parse_args()

    from prefect import flow
    from prefect.context import FlowRunContext
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    from aisched_prefect import AISchedTaskRunner, ai_task
    from aisched_prefect.control.process import ControlPlaneProcess
    from blocks import AuthorityBlock, BudgetBlock, ClusterBlock, Grant, ModelLimit

    call = ai_task(kind="model-call", model="bench-model", est_tokens=10, name="model-call")(_call)
    home = Path(tempfile.mkdtemp())
    with prefect_test_harness(server_startup_timeout=60), temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        plane = ControlPlaneProcess(home, declared="1 worker x 1 GPU, 24 GB, A10").start()
        try:
            plane.apply("authority", "bench", AuthorityBlock(grants=[Grant(id="all", principal="bench/calls",
                                                                           max_cost_per_run=1e6)]))
            plane.apply("budget", "bench", BudgetBlock(gpu_hour_prices={"*": 1.0}, token_prices_per_1k={"*": 0.001}))
            plane.apply("cluster", "bench", ClusterBlock(model_limits=[ModelLimit(model="bench-model",
                                                                                   per_minute=args.per_minute)]))
            token = plane.issue("bench/calls", authority="bench", budget="bench", cluster="bench", tenant="bench")

            @flow(name="model-rate", task_runner=AISchedTaskRunner(control_plane=plane.url, credential=token,
                                                                   max_workers=args.max_workers))
            def burst() -> tuple[list[float], str]:
                return [f.result() for f in call.map(range(args.calls))], str(FlowRunContext.get().flow_run.id)

            starts, run = burst()
            settled = [r.payload for r in plane.records(run) if r.kind == "settlement"]
        finally:
            plane.stop()

    slots = sorted(s["model_limit"]["slot"] for s in settled)
    gaps = [b - a for a, b in zip(slots, slots[1:])]
    starts.sort()
    want = 60.0 / args.per_minute
    rate = (len(starts) - 1) / (starts[-1] - starts[0]) * 60.0
    lag = [s - t for s, t in zip(starts, slots)]
    print(f"{args.calls} model calls, per_minute={args.per_minute:g} (one start every {want:.3f} s), "
          f"{args.max_workers} in flight")
    print(f"slot gaps (settlements):  min {min(gaps):.4f} s, max {max(gaps):.4f} s")
    print(f"body start after its slot: median {sorted(lag)[len(lag) // 2] * 1000:.0f} ms, max {max(lag) * 1000:.0f} ms")
    print(f"body starts over the burst: {rate:.1f}/min ({rate / args.per_minute - 1:+.1%} vs configured)")
    windows = [sum(1 for s in starts if a <= s < a + 60.0) for a in starts if a + 60.0 <= starts[-1] + want]
    if windows:
        print(f"starts in each 60 s window ({len(windows)} windows): min {min(windows)}, max {max(windows)} "
              f"({max(windows) / args.per_minute - 1:+.1%} vs configured at most)")
    tens = [sum(1 for s in starts if a <= s < a + 10.0) for a in starts if a + 10.0 <= starts[-1] + want]
    print(f"starts in each 10 s window: min {min(tens)}, max {max(tens)} (configured {args.per_minute / 6:g})")


if __name__ == "__main__":
    main()
