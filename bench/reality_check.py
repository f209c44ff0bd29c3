"""Does the simulator tell the truth? The same small workload, simulated and run for real, side by side.

A slice of the Philly trace is scaled down to seconds (sleep tasks), run
through AISchedTaskRunner(queue=True) on a LocalGPUCluster of declared GPUs,
one flow run per tenant, each task submitted at its (scaled) submit time; the
same jobs go through the simulator with the same policy and cluster shape.

    .venv/bin/python bench/reality_check.py --jobs 40 --scale 600
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from bench.simulate import TRACE, load  # noqa: E402
from dask_gpu.queue_policy import FairShare, Job  # noqa: E402
from aisched_prefect.simulator import simulate  # noqa: E402


EST = 1.0


def _sleep(seconds: float) -> tuple[float, float]:
    start = time.time()
    time.sleep(seconds)
    return start, time.time()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--start", default="2017-11-21")
    p.add_argument("--end", default="2017-11-22")
    p.add_argument("--jobs", type=int, default=40)
    p.add_argument("--scale", type=float, default=600.0, help="trace seconds per real second")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--gpus", type=int, default=2)
    args = p.parse_args()

    trace_jobs, durations, _ = load(TRACE, args.start, args.end, args.gpus, 21600, "clip", 4)
    picked = trace_jobs[: args.jobs]
    t0 = picked[0].submit
    # The runner sees each task's declared est_seconds (1 s here); the simulated policy sees the same.
    jobs = [Job(id=j.id, tenant=j.tenant, gpus=j.gpus, submit=(j.submit - t0) / args.scale, estimate=EST)
            for j in picked]
    real_durations = {j.id: max(durations[j.id] / args.scale, 0.2) for j in picked}
    sim = simulate(jobs, real_durations, FairShare(), args.hosts, args.gpus)

    from prefect import flow
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    from aisched_prefect import AISchedTaskRunner, ai_task
    from blocks import AuthorityBlock, BudgetBlock, Grant
    from dask_gpu import LocalGPUCluster

    tasks = {g: ai_task(gpus=g, kind="training", est_seconds=EST, name=f"sleep-{g}gpu")(_sleep) for g in (1, 2, 4, 8)}

    ledger = f"sqlite:///{tempfile.mkdtemp()}/reality.db"
    auth = AuthorityBlock(grants=[Grant(id="all", principal="*", max_gpus=8, max_cost_per_run=1e6)])
    spec = f"{args.hosts} workers x {args.gpus} GPUs, 80 GB, H100"
    with prefect_test_harness(server_startup_timeout=60), temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}), \
            LocalGPUCluster(declared=spec) as cluster:
        origin = time.time() + 8.0  # every flow run started before the first submit
        done: dict[int, tuple[float, float]] = {}

        def tenant_flow(tenant: str, mine: list[Job]) -> None:
            @flow(name=f"reality-{tenant}", task_runner=AISchedTaskRunner(
                principal=f"{tenant}/jobs", authority=auth, budget=BudgetBlock(gpu_hour_prices={"*": 1.0}),
                address=cluster.scheduler_address, ledger_url=ledger, queue=True, max_workers=64))
            def run_tenant() -> None:
                futures = []
                for j in mine:
                    time.sleep(max(0.0, origin + j.submit - time.time()))
                    futures.append((j, tasks[j.gpus].submit(real_durations[j.id])))
                for j, f in futures:
                    done[j.id] = f.result()
            run_tenant()

        by_tenant: dict[str, list[Job]] = {}
        for j in jobs:
            by_tenant.setdefault(j.tenant, []).append(j)
        threads = [threading.Thread(target=tenant_flow, args=(t, js)) for t, js in by_tenant.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    ends = {i: e - origin for i, (_, e) in done.items()}
    real_makespan = max(ends.values())
    real_jct = sum(ends[j.id] - j.submit for j in jobs) / len(jobs)
    print(f"{len(jobs)} jobs, {len(by_tenant)} tenants, {args.hosts} hosts x {args.gpus} GPUs, 1 s = {args.scale:g} trace s")
    print(f"{'':12} {'makespan':>10} {'mean JCT':>10}")
    print(f"{'simulated':12} {sim.makespan:>9.2f}s {sim.mean_jct:>9.2f}s")
    print(f"{'real':12} {real_makespan:>9.2f}s {real_jct:>9.2f}s")
    print(f"{'real / sim':12} {real_makespan / sim.makespan:>10.3f} {real_jct / sim.mean_jct:>10.3f}")


if __name__ == "__main__":
    main()
