"""The cluster's one queue (runner queue=True): runs of all flow runs wait in a scheduler plugin, fairly."""

from __future__ import annotations

import threading
import time

import pytest
from prefect import flow

from aisched_prefect import Ledger, ai_task
from tests.helpers import authority, runner

pytestmark = pytest.mark.usefixtures("prefect_api")


@ai_task(gpus=2, gpu_type="H100", kind="training", est_seconds=2)
def train(i):
    start = time.time()
    time.sleep(0.6)
    return start


def status(client):
    return client.sync(client.scheduler.gpu_queue_status)


@ai_task(gpus=2, gpu_type="H100", kind="training", est_seconds=4)
def train_longer(i):
    start = time.time()
    time.sleep(1.5)
    return start


def test_runs_of_two_tenants_share_the_queue_fairly(gpu_cluster, dask_client, sqlite_url):
    """Tenant a fills the queue first; tenant b's runs start before a's backlog is done (FIFO would not)."""
    from dask_gpu import install_queue

    auth = authority(principal="*")
    results: dict[str, list[float]] = {}

    def tenant(name: str, n: int) -> None:
        @flow(name=f"queue-{name}", task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, principal=f"{name}/jobs",
                                                       authority=auth, queue=True, max_workers=8))
        def jobs():
            return [f.result() for f in train_longer.map(range(n))]

        results[name] = jobs()

    install_queue(dask_client)  # (idempotent) so this test can see a's backlog before b starts
    threads = [threading.Thread(target=tenant, args=("a", 8)), threading.Thread(target=tenant, args=("b", 2))]
    threads[0].start()
    deadline = time.time() + 60
    while status(dask_client)["queued"] < 4:  # a's backlog waits (two hosts hold two of its runs at a time)
        assert time.time() < deadline and threads[0].is_alive(), "tenant a's runs never queued"
        time.sleep(0.05)
    threads[1].start()
    for t in threads:
        t.join(timeout=180)
    assert len(results["a"]) == 8 and len(results["b"]) == 2
    assert min(results["b"]) < sorted(results["a"])[-2]  # b did not wait behind a's whole backlog
    after = status(dask_client)
    assert after["queued"] == 0 and after["running"] == 0  # every run left the queue and gave its GPUs back
    assert sum(r.kind == "settlement" for r in Ledger(sqlite_url).records()) == 10


def test_never_more_gpu_runs_on_dask_than_fit(gpu_cluster, dask_client, sqlite_url):
    """Runs are released to Dask only when they can start: Dask never queues a GPU run behind another."""
    seen = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            processing = dask_client.processing()
            seen.append(sum(1 for tasks in processing.values() for k in tasks if "train" in str(k)))
            time.sleep(0.05)

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, queue=True, max_workers=8))
    def jobs():
        return [f.result() for f in train.map(range(6))]

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert len(jobs()) == 6
    finally:
        stop.set()
        watcher.join()
    assert max(seen) <= 2  # two H100 hosts of 2 GPUs: two 2-GPU runs at a time, none waiting inside Dask


def test_a_dead_flow_process_leaves_nothing_in_the_queue(gpu_cluster, dask_client, sqlite_url, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from prefect.settings import PREFECT_API_URL

    script = tmp_path / "victim.py"
    script.write_text(f'''
import time
from prefect import flow
from aisched_prefect import ai_task
from tests.helpers import runner

@ai_task(gpus=2, gpu_type="H100", kind="training", est_seconds=60)
def hog(i):
    time.sleep(2)

@flow(task_runner=runner({gpu_cluster.scheduler_address!r}, {sqlite_url!r}, queue=True, max_workers=8))
def victim():
    [f.result() for f in hog.map(range(6))]

victim()
''')
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_LOGGING_LEVEL": "ERROR",
           "PYTHONPATH": str(Path(__file__).parent.parent)}
    from dask_gpu import install_queue

    install_queue(dask_client)  # (idempotent) so this test can read the queue before the victim installs it
    proc = subprocess.Popen([sys.executable, str(script)], env=env)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            s = status(dask_client)
            if s["running"] >= 1 and s["queued"] >= 1:
                break
            time.sleep(0.1)
        assert s["running"] >= 1 and s["queued"] >= 1, s
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    for _ in range(100):  # the scheduler notices the client is gone
        s = status(dask_client)
        if s["queued"] == 0 and s["running"] == 0:
            break
        time.sleep(0.1)
    assert s["queued"] == 0 and s["running"] == 0, s

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, queue=True))
    def survivor():
        return [f.result() for f in train.map(range(2))]

    assert len(survivor()) == 2


def test_the_cluster_blocks_tenant_weights_reach_the_queue(gpu_cluster, dask_client, sqlite_url):
    from blocks import ClusterBlock
    from dask_gpu import install_queue

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, queue=True,
                             cluster=ClusterBlock(tenant_weights={"team-a": 3.0, "team-b": 0.5})))
    def weighted():
        return train(0)

    try:
        weighted()
        assert status(dask_client)["weights"] == {"team-a": 3.0, "team-b": 0.5}
    finally:
        install_queue(dask_client, weights={})  # the cluster is shared by the other tests
    assert status(dask_client)["weights"] == {}


def test_aisched_queue_shows_what_runs_and_what_waits(gpu_cluster, dask_client, sqlite_url):
    import json

    from typer.testing import CliRunner

    from aisched_prefect.cli import app
    from dask_gpu import install_queue

    install_queue(dask_client)
    cli = CliRunner()
    address = gpu_cluster.scheduler_address

    @flow(name="queue-shown", task_runner=runner(address, sqlite_url, principal="c/jobs", authority=authority(principal="*"),
                                                 queue=True, max_workers=8))
    def jobs():
        return [f.result() for f in train_longer.map(range(4))]

    worker = threading.Thread(target=jobs)
    worker.start()
    try:
        deadline = time.time() + 60
        while True:  # two H100 hosts: two of c's runs on GPUs, two waiting
            out = cli.invoke(app, ["queue", "--address", address, "--json"])
            assert out.exit_code == 0, out.output
            state = json.loads(out.output)
            if state["running"] == 2 and state["queued"] == 2:
                break
            assert time.time() < deadline and worker.is_alive(), state
            time.sleep(0.05)
        runs = state["runs"]
        assert [r["state"] for r in runs] == ["running", "running", "queued", "queued"]
        assert all(r["tenant"] == "c" and r["gpus"] == 2 and not r["preemptible"] for r in runs)
        assert {r["worker"] for r in runs[:2]} <= set(state["free"]) and runs[2]["worker"] is None
        table = cli.invoke(app, ["queue", "--address", address])
        assert table.exit_code == 0 and "waiting" in table.output and "running" in table.output
    finally:
        worker.join(timeout=120)


def test_aisched_queue_names_a_wrong_address_and_a_cluster_without_the_queue():
    from typer.testing import CliRunner

    from aisched_prefect.cli import app
    from dask_gpu import LocalGPUCluster

    cli = CliRunner()
    out = cli.invoke(app, ["queue", "--address", "tcp://127.0.0.1:9"])
    assert out.exit_code == 2 and "--address" in out.output
    with LocalGPUCluster(declared="1 worker x 1 GPU, 24 GB, A10") as bare:
        out = cli.invoke(app, ["queue", "--address", bare.scheduler_address])
        assert out.exit_code == 1 and "AISchedTaskRunner(queue=True)" in out.output
