"""A worker process is killed for real mid-task: the task is retried, nothing stays held, each attempt is charged once."""

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
