"""Per-task overhead: prefect-dask's DaskTaskRunner vs AISchedTaskRunner (admission on) vs ThreadPoolTaskRunner.

The same flow of N trivial tasks runs under each runner against the same
running GPU-aware Dask cluster and the same Prefect test server. AISched's
tasks are @ai_task(gpus=1) and pass the whole admission path: feasibility,
pricing, grant check, budget hold + evidence (one SQLite transaction), device
assignment on the worker, settlement + evidence. Prints seconds, per-task
overhead and the ratios the walking-skeleton issue sets as targets.

    make bench            # or: .venv/bin/python bench/overhead.py --tasks 200
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "ERROR")

from distributed import Client
from prefect import flow, task
from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.testing.utilities import prefect_test_harness
from prefect_dask import DaskTaskRunner

from aisched_prefect import AISchedTaskRunner, Ledger, ai_task
from blocks import AuthorityBlock, BudgetBlock, Grant


@contextmanager
def external_cluster(workers: int, per_worker: str):
    """A Dask scheduler and GPU workers in their own processes, started as an operator would.

    Keeping the scheduler out of the flow process is how a shared cluster runs,
    and leaves the flow process to the runner being measured.
    """
    tmp = tempfile.mkdtemp()
    scheduler_file = os.path.join(tmp, "scheduler.json")
    common = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs = [subprocess.Popen([DASK, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                               "--scheduler-file", scheduler_file], **common)]
    try:
        procs.append(subprocess.Popen(
            [DASK, "worker", "--scheduler-file", scheduler_file, "--nworkers", str(workers), "--nthreads", "5",
             "--host", "127.0.0.1", "--no-dashboard", "--preload", "dask_gpu.preload"],
            env={**os.environ, "DASK_GPU_DECLARED": per_worker}, **common))
        deadline = time.time() + 60
        while not os.path.exists(scheduler_file) and time.time() < deadline:
            time.sleep(0.1)
        with Client(scheduler_file=scheduler_file, set_as_default=False) as client:
            client.wait_for_workers(workers, timeout=60)
            yield client.scheduler.address
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(timeout=30)


@task
def trivial(i: int) -> int:
    return i


SETTLE_SECONDS = 8.0
DASK = os.path.join(os.path.dirname(sys.executable), "dask")


@ai_task(gpus=1, kind="inference", est_seconds=1)
def trivial_ai(i: int) -> int:
    return i


def timed(make_flow, n: int, repeats: int) -> float:
    """Best of `repeats` timed runs after a warm-up.

    The test server runs in this process and works off each flow's events for
    a while after the flow ends; a pause before each run keeps one runner's
    backlog from being billed to the next.
    """
    f = make_flow()
    f(n)  # warm-up: imports on the workers, first connections
    best = float("inf")
    for _ in range(repeats):
        time.sleep(SETTLE_SECONDS)
        t0 = time.perf_counter()
        f(n)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gpus-per-worker", default="4 GPUs, 80 GB, H100")
    parser.add_argument("--queue", action="store_true",
                        help="also time AISchedTaskRunner(queue=True): every run waits in the cluster's one queue")
    args = parser.parse_args()
    n = args.tasks
    logging.getLogger("distributed").setLevel(logging.ERROR)
    ledger_url = f"sqlite:///{tempfile.mkdtemp()}/bench-ledger.db"

    with prefect_test_harness(server_startup_timeout=60), temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        os.environ["PREFECT_API_URL"] = PREFECT_API_URL.value()  # prefect-dask's workers need the API
        with external_cluster(args.workers, args.gpus_per_worker) as address:
            logging.getLogger("distributed").setLevel(logging.ERROR)

            def make(runner, fn):
                @flow(task_runner=runner)
                def bench_flow(n: int) -> int:
                    return sum(f.result() for f in fn.map(range(n)))
                return bench_flow

            def aisched_runner(queue: bool = False) -> AISchedTaskRunner:
                return AISchedTaskRunner(
                    principal="bench/flow", address=address, ledger_url=ledger_url, queue=queue,
                    authority=AuthorityBlock(grants=[Grant(id="bench", principal="bench/*", max_gpus=1, max_cost_per_run=1)]),
                    budget=BudgetBlock(limit=1_000_000, gpu_hour_prices={"*": 1.0}),
                )

            aisched = aisched_runner()
            results = {
                "ThreadPoolTaskRunner": timed(lambda: make(ThreadPoolTaskRunner(), trivial), n, args.repeats),
                "AISchedTaskRunner (admission on)": timed(lambda: make(aisched, trivial_ai), n, args.repeats),
                "prefect-dask DaskTaskRunner": timed(lambda: make(DaskTaskRunner(address=address), trivial), n, args.repeats),
            }
            if args.queue:
                queued = aisched_runner(queue=True)
                results["AISchedTaskRunner (queue=True)"] = timed(lambda: make(queued, trivial_ai), n, args.repeats)
    records = Ledger(ledger_url).verify().records
    print(f"\n{n} trivial tasks per flow, same Dask cluster ({args.workers} workers x {args.gpus_per_worker}), {os.cpu_count()} cores")
    for name, seconds in results.items():
        print(f"  {name:34s} {seconds:7.2f} s   {1000 * seconds / n:7.2f} ms/task")
    ours, dask, threads = (results["AISchedTaskRunner (admission on)"], results["prefect-dask DaskTaskRunner"],
                           results["ThreadPoolTaskRunner"])
    print(f"  AISched / prefect-dask     = {ours / dask:.3f}   (target <= 0.20)")
    print(f"  AISched / ThreadPool       = {ours / threads:.3f}   (target <= 2.0)")
    if "AISchedTaskRunner (queue=True)" in results:
        print(f"  queue=True / admission on  = {results['AISchedTaskRunner (queue=True)'] / ours:.3f}")
    print(f"  evidence records written: {records} (2 per AI task run; chain verified)")


if __name__ == "__main__":
    main()
