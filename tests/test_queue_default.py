"""The one queue is the default: every GPU run (whole, memory-sized, fractional) waits in the cluster's queue and goes
to its worker only when the policy starts it; tenants share it fairly. (The session's control plane runs with its defaults.)"""

from __future__ import annotations

import threading
import time

import pytest
from prefect import flow

from aisched_prefect import ai_task
from tests.helpers import authority, tenant

pytestmark = pytest.mark.usefixtures("prefect_api")


@ai_task(gpus=2, gpu_type="H100", kind="training", est_seconds=4)
def train(i):
    start = time.time()
    time.sleep(1.0)
    return start


@ai_task(gpus=1, gpu_memory_gb=40, kind="inference", est_seconds=4)
def embed(i):
    time.sleep(0.5)
    return i


@ai_task(gpus=0.5, gpu_type="A10", kind="inference", est_seconds=4)
def half(i):
    time.sleep(0.5)
    return i


def test_every_gpu_run_reaches_its_worker_only_when_it_can_start(control_plane, dask_client):
    """Whole, memory-sized and fractional runs at once: what each worker was given (Dask tasks, and runs handed
    straight to it) never exceeds its GPUs, so no run waits on a worker behind another (the control plane's runner
    was given no queue= at all)."""
    workers = {addr: w["resources"].get("GPU", 0) for addr, w in dask_client.scheduler_info(n_workers=-1)["workers"].items()}
    over: list = []
    busy: list = []
    stop = threading.Event()

    def gpus_processing(dask_scheduler) -> dict:
        """Worker -> GPUs of the admitted runs Dask processes there (their resource annotation: keys are opaque)."""
        return {ws.address: sum((ts.resource_restrictions or {}).get("GPU", 0.0) for ts in ws.processing
                                if str(ts.key).startswith("aisched-")) for ws in dask_scheduler.workers.values()}

    def gpus_handed_over(dask_worker) -> float:
        """GPUs of the runs the control plane handed straight to this worker (the queue placed them)."""
        return sum(t.request.gpus for _, t in dask_worker.plugins["dask-gpu"].handover.callers.values())

    def watch():
        while not stop.is_set():
            handed = dask_client.run(gpus_handed_over)
            for addr, held in dask_client.run_on_scheduler(gpus_processing).items():
                held += handed.get(addr, 0.0)
                busy.append(held)
                if held > workers.get(addr, 0):
                    over.append((addr, held))
            time.sleep(0.05)

    t = tenant(control_plane)

    @flow(task_runner=t.runner(max_workers=24))
    def mixed():
        futures = [*train.map(range(6)), *embed.map(range(6)), *half.map(range(6))]
        return [f.result() for f in futures]

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert len(mixed()) == 18
    finally:
        stop.set()
        watcher.join()
    assert not over, over[:3]
    assert max(busy) > 0
    status = dask_client.sync(dask_client.scheduler.gpu_queue_status)
    assert status["queued"] == 0 and status["running"] == 0  # every run left the queue and gave its GPUs back


@ai_task(gpus=2, gpu_type="H100", kind="training", est_seconds=4)
def train_longer(i):
    start = time.time()
    time.sleep(3)  # a's backlog lasts 12 s: long enough for b's flow run to start on a loaded machine
    return start


def test_runs_of_two_tenants_share_the_queue_fairly(control_plane, dask_client):
    """Tenant a fills the queue first; tenant b's runs start before a's backlog is done (FIFO would not)."""
    a = tenant(control_plane, authority_=authority(principal="qa/jobs"), principal="qa/jobs")
    b = tenant(control_plane, authority_=authority(principal="qb/jobs"), principal="qb/jobs")
    results: dict[str, list[float]] = {}

    def run(name: str, t, n: int) -> None:
        @flow(name=f"queue-{name}", task_runner=t.runner(max_workers=8))
        def jobs():
            return [f.result() for f in train_longer.map(range(n))]

        results[name] = jobs()

    threads = [threading.Thread(target=run, args=("a", a, 8)), threading.Thread(target=run, args=("b", b, 2))]
    threads[0].start()
    deadline = time.time() + 60
    while dask_client.sync(dask_client.scheduler.gpu_queue_status)["queued"] < 4:  # a's backlog waits
        assert time.time() < deadline and threads[0].is_alive(), "tenant a's runs never queued"
        time.sleep(0.05)
    threads[1].start()
    for th in threads:
        th.join(timeout=180)
    assert len(results["a"]) == 8 and len(results["b"]) == 2
    assert min(results["b"]) < sorted(results["a"])[-2]  # b did not wait behind a's whole backlog
