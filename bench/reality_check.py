"""Does the simulator tell the truth? The same small workload, simulated and run for real, side by side.

A slice of the Philly trace is scaled down to seconds (sleep tasks) and run
for real through a control plane (`aisched serve --declared ...`, its own
process, with a local GPU cluster of declared devices) and the cluster's one
queue with its default policy (FinishTimeFair), one flow run per tenant, each
task submitted at its (scaled) submit time and declaring its (scaled) estimate
as est_seconds (`--estimates`: a user's rounded-up limit by default, as
`bench/simulate.py`; `oracle`: its real run time), sleeping its real run time; jobs wider than a host run as gangs across whole workers (the
slice must hold at least one, across two workers). The same jobs go through
the simulator (`dask_gpu.sim.simulator`) with the same policy, estimates and
cluster shape. Prints makespan and mean JCT of both, and real / simulated.

    .venv/bin/python bench/reality_check.py --jobs 30 --scale 600 [--estimates user|oracle|none]
    .venv/bin/python bench/reality_check.py --jobs 30 --scale 600 --time-rules scaled

Both sides run the live configuration (`PolicyConfig`; the simulator with the plugin's event batching). At
600x the policy's time rules (the 6 h horizon of a tenant's pool, the 1 h quiet time before the tail rule, the
weekly half-life) are hours of real time and never fire; `--time-rules scaled` divides them by `--scale` on
both sides (the live queue reads them from Dask's config, `DASK_DASK_GPU__QUEUE_POLICY__...`, in the cluster's
environment), so the rules fire as they would over the trace's day.
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

from bench.trace import TRACE, load  # noqa: E402
from dask_gpu.policies.config import PolicyConfig  # noqa: E402
from dask_gpu.sim.policies import Job, is_gang  # noqa: E402
from dask_gpu.sim.simulator import ESTIMATES, simulate, with_estimates  # noqa: E402

MIN_SECONDS = 0.2  # the shortest sleep a job gets


def _sleep(seconds: float) -> tuple[float, float]:
    start = time.time()
    time.sleep(seconds)
    return start, time.time()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--start", default="2017-11-21")
    p.add_argument("--end", default="2017-11-22")
    p.add_argument("--jobs", type=int, default=30)
    p.add_argument("--scale", type=float, default=600.0, help="trace seconds per real second")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--gpus", type=int, default=2, help="GPUs per host")
    p.add_argument("--estimates", choices=ESTIMATES, default="user", help="what each task declares as est_seconds")
    p.add_argument("--time-rules", choices=["live", "scaled"], default="live",
                   help="the policy's time rules as live (seconds) or divided by --scale (they fire at this speed)")
    p.add_argument("--lead", type=float, default=15.0, help="seconds for every flow run to start before the first submit")
    args = p.parse_args()

    trace_jobs, durations, _ = load(TRACE, args.start, args.end, args.hosts, args.gpus, 21600, "clip", 4)
    picked = [j for j in trace_jobs if j.gpus <= 2 * args.gpus][: args.jobs]  # gangs over at most two workers
    size = [args.gpus] * args.hosts
    gangs = [j for j in picked if is_gang(j, size)]
    if not gangs:
        sys.exit(f"the first {args.jobs} jobs of the slice hold no job wider than a host: choose another --start")
    t0 = picked[0].submit
    real_durations = {j.id: max(durations[j.id] / args.scale, MIN_SECONDS) for j in picked}
    # The queue sees each task's declared est_seconds (its scaled estimate); the simulated policy sees the same.
    asked = {j.id: j.estimate for j in with_estimates(picked, durations, args.estimates, limit=21600)}
    jobs = [Job(id=j.id, tenant=j.tenant, gpus=j.gpus, submit=(j.submit - t0) / args.scale,
                estimate=max(asked[j.id] / args.scale, real_durations[j.id])) for j in picked]
    live = PolicyConfig()
    rules = {"horizon": live.horizon, "tail_quiet": live.tail_quiet, "half_life": live.half_life}
    if args.time_rules == "scaled":
        rules = {k: v / args.scale for k, v in rules.items() if v is not None}
        for k, v in rules.items():  # the cluster's scheduler reads them from Dask's config
            os.environ[f"DASK_DASK_GPU__QUEUE_POLICY__{k.upper()}"] = repr(v)
    config = PolicyConfig(**rules)
    sim = simulate(jobs, real_durations, config.build(), args.hosts, args.gpus, batch=config.batch_events)

    from prefect import flow
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    from aisched_prefect import AISchedTaskRunner, ai_task
    from aisched_prefect.control.process import ControlPlaneProcess
    from blocks import AuthorityBlock, BudgetBlock, Grant

    tasks = {j.id: ai_task(gpus=j.gpus, kind="training", est_seconds=j.estimate, name=f"job-{j.id}",
                           hosts=-(-j.gpus // args.gpus) if is_gang(j, size) else None)(_sleep)  # a gang asks for hosts
             for j in jobs}
    by_tenant: dict[str, list[Job]] = {}
    for j in jobs:
        by_tenant.setdefault(j.tenant, []).append(j)
    spec = f"{args.hosts} workers x {args.gpus} GPUs, 80 GB, H100"
    done: dict[int, tuple[float, float]] = {}
    failed: list[str] = []
    with prefect_test_harness(server_startup_timeout=60), temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        plane = ControlPlaneProcess(Path(tempfile.mkdtemp()), declared=spec).start()
        try:
            plane.apply("authority", "reality", AuthorityBlock(grants=[
                Grant(id=f"g-{t}", principal=f"{t}/jobs", max_gpus=2 * args.gpus, max_cost_per_run=1e6)
                for t in by_tenant]))
            plane.apply("budget", "reality", BudgetBlock(gpu_hour_prices={"*": 1.0}))
            tokens = {t: plane.issue(f"{t}/jobs", authority="reality", budget="reality", tenant=t) for t in by_tenant}
            origin = time.time() + args.lead

            def tenant_flow(tenant: str, mine: list[Job]) -> None:
                @flow(name=f"reality-{tenant}", task_runner=AISchedTaskRunner(
                    control_plane=plane.url, credential=tokens[tenant], max_workers=64))
                def run_tenant() -> None:
                    futures = []
                    for j in mine:
                        time.sleep(max(0.0, origin + j.submit - time.time()))
                        futures.append((j, tasks[j.id].submit(real_durations[j.id])))
                    for j, f in futures:
                        done[j.id] = f.result()

                try:
                    run_tenant()
                except Exception as exc:  # said below; the others go on
                    failed.append(f"{tenant}: {type(exc).__name__}: {exc}")

            threads = [threading.Thread(target=tenant_flow, args=(t, js)) for t, js in by_tenant.items()]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            placed = {r.payload["task"]: r.payload.get("placement") or {} for r in plane.ledger().records()
                      if r.kind == "settlement" and r.payload.get("outcome") == "completed"}
        finally:
            plane.stop()
    if failed or len(done) != len(jobs):
        sys.exit(f"{len(jobs) - len(done)} jobs did not complete: {failed}")
    ends = {i: e - origin for i, (_, e) in done.items()}
    starts = {i: s - origin for i, (s, _) in done.items()}
    real_makespan = max(ends.values())
    real_jct = sum(ends[j.id] - j.submit for j in jobs) / len(jobs)
    print(f"{len(jobs)} jobs ({len(gangs)} gangs over two workers), {len(by_tenant)} tenants, {args.hosts} hosts x "
          f"{args.gpus} GPUs, slice from {args.start}, 1 s = {args.scale:g} trace s, policy {sim.policy} "
          f"(FinishTimeFair, the live configuration) live and simulated, estimates {args.estimates}, time rules "
          f"{args.time_rules} (horizon {config.horizon:g} s, tail quiet {config.tail_quiet:g} s)")
    print(f"{'':12} {'makespan':>10} {'mean JCT':>10}")
    print(f"{'simulated':12} {sim.makespan:>9.2f}s {sim.mean_jct:>9.2f}s")
    print(f"{'real':12} {real_makespan:>9.2f}s {real_jct:>9.2f}s")
    print(f"{'real / sim':12} {real_makespan / sim.makespan:>10.3f} {real_jct / sim.mean_jct:>10.3f}")
    lag = sorted(starts[j.id] - sim.started[j.id] for j in jobs)
    print(f"start real - simulated per job: median {lag[len(lag) // 2]:.2f}s, min {lag[0]:.2f}s, max {lag[-1]:.2f}s")
    for g in (j for j in jobs if is_gang(j, size)):
        workers = placed.get(f"job-{g.id}", {}).get("workers") or []
        print(f"gang job {g.id} ({g.gpus} GPUs, {real_durations[g.id]:.1f}s) on {len(workers)} workers ({', '.join(workers)}): "
              f"started at {starts[g.id]:.2f}s real, {sim.started[g.id]:.2f}s simulated")


if __name__ == "__main__":
    main()
