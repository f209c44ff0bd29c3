"""Workers joining and dying under a running flow: feasibility follows them, nothing stays held, each attempt is charged once."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from prefect import flow

from aisched_prefect import Ledger, ai_task
from dask_gpu import LocalGPUCluster
from dask_gpu.plugin import PLUGIN_NAME
from tests.helpers import runner

pytestmark = pytest.mark.usefixtures("prefect_api")


def _held(dask_worker):
    return dask_worker.plugins[PLUGIN_NAME].allocator.holders()


def test_killed_worker_task_is_retried_and_charged_once_per_attempt(tmp_path, sqlite_url):
    pid_file, marker = tmp_path / "pid", tmp_path / "first-attempt-done"

    @ai_task(gpus=2, gpu_type="H100", kind="training", est_seconds=600, retries=1)
    def long_train(pid_path: str, marker_path: str):
        if not Path(marker_path).exists():  # first attempt: announce ourselves, then run "for a long time"
            Path(marker_path).write_text("x")
            Path(pid_path).write_text(str(os.getpid()))
            time.sleep(120)
        return os.getpid()

    def kill_when_running():
        deadline = time.time() + 60
        while not pid_file.exists() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(int(pid_file.read_text()), signal.SIGKILL)

    with LocalGPUCluster(declared="2 workers x 2 GPUs, 80 GB, H100") as cluster:
        @flow(task_runner=runner(cluster.scheduler_address, sqlite_url))
        def nightly():
            return long_train(str(pid_file), str(marker))

        killer = threading.Thread(target=kill_when_running)
        killer.start()
        t0 = time.perf_counter()
        survivor_pid = nightly()
        killer.join()
        assert time.perf_counter() - t0 < 90
        assert survivor_pid != int(pid_file.read_text())

        from distributed import Client

        with Client(cluster, set_as_default=False) as client:
            client.wait_for_workers(2, timeout=60)  # the nanny brought the killed worker back
            assert all(h == {} for h in client.run(_held).values())  # nothing held anywhere

    ledger = Ledger(sqlite_url)
    records = ledger.records()
    assert [r.kind for r in records] == ["admission", "settlement", "admission", "settlement"]
    died, done = records[1].payload, records[3].payload
    assert died["outcome"] == "worker-died" and "KilledWorker" in died["error"]
    assert done["outcome"] == "completed"
    # The dead attempt is charged for the time it can have run, never more than its hold.
    assert 0 < died["settlements"][0]["charged"] <= records[0].payload["holds"][0]["reserved"]
    assert died["settlements"][0]["charged"] < 0.2 * records[0].payload["holds"][0]["reserved"]
    account = ledger.accounts()[0]
    assert account["pending"] == 0
    assert account["posted"] == pytest.approx(died["settlements"][0]["charged"] + done["settlements"][0]["charged"], abs=1e-5)
    assert ledger.verify().ok


def test_feasibility_follows_a_worker_joining(sqlite_url):
    """A request no worker can hold fails at once; once a host that can hold it joins, it runs."""
    import subprocess
    import sys

    from distributed import Client, LocalCluster

    from aisched_prefect import AdmissionDenied

    @ai_task(gpus=1, gpu_type="L40S", kind="inference", est_seconds=5)
    def on_l40s():
        from dask_gpu import current_devices

        return [d.gpu_type for d in current_devices()]

    def start_worker(address: str, declared: str, name: str) -> subprocess.Popen:
        return subprocess.Popen(
            [os.path.join(os.path.dirname(sys.executable), "dask-gpu-worker"), address, "--nthreads", "2",
             "--host", "127.0.0.1", "--no-dashboard", "--name", name, "--declared", declared],
            env={**os.environ, "PYTHONPATH": os.path.dirname(__file__)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    with LocalCluster(n_workers=0, processes=True, host="127.0.0.1", dashboard_address=":0") as cluster, \
            Client(cluster, set_as_default=False) as client:
        address = cluster.scheduler_address
        workers = [start_worker(address, "2 GPUs, 80 GB, H100", "h100-host")]
        try:
            client.wait_for_workers(1, timeout=60)
            budget_with_l40s = runner(address, sqlite_url).config.budget.model_copy(
                update={"gpu_hour_prices": {"H100": 4.0, "L40S": 2.0}})

            @flow(task_runner=runner(address, sqlite_url, budget=budget_with_l40s))
            def f():
                try:
                    on_l40s()
                    raise AssertionError("admitted with no L40S in the cluster")
                except AdmissionDenied as exc:
                    first = exc.stage, str(exc)
                workers.append(start_worker(address, "1 GPU, 48 GB, L40S", "l40s-host"))
                client.wait_for_workers(2, timeout=60)
                return first, on_l40s()

            (stage, message), types = f()
            assert stage == "feasibility" and "largest worker h100-host has 2 x H100 80 GB" in message
            assert types == ["L40S"]
        finally:
            for w in workers:
                w.terminate()
                w.wait(timeout=30)
