"""A run that waits in the cluster's queue starts on a worker that joins after it was admitted (how a worker job
dask-gpu-slurm submits for it gets it): admission named the workers that could hold it then; the queue widens that
to a new worker whose devices hold it."""

from __future__ import annotations

import threading
import time

import pytest
from prefect import flow

from tests.clusterprocs import ClusterProcs
from tests.helpers import tenant
from tests.test_slurm import hold_task, wait_for

pytestmark = pytest.mark.usefixtures("prefect_api")


def test_a_waiting_run_starts_on_a_worker_that_joins(tmp_path):
    (tmp_path / "scratch").mkdir()
    cluster = ClusterProcs(tmp_path / "cluster", env={"DASK_TEMPORARY_DIRECTORY": str(tmp_path / "scratch")})
    marker = tmp_path / "markers"
    marker.mkdir()
    try:
        cluster.start_scheduler()
        cluster.start_worker("h100-a", "1 GPU, 80 GB, H100")
        cluster.start_worker("a10", "1 GPU, 24 GB, A10")  # admission's eligible list is a real restriction
        cluster.wait_for_workers(2)
        cluster.start_plane()
        t = tenant(cluster.plane)

        @flow(task_runner=t.runner())
        def two():
            futures = [hold_task.submit(str(marker), "first"), hold_task.submit(str(marker), "second")]
            return [f.result() for f in futures]

        out: list = []
        runner = threading.Thread(target=lambda: out.append(two()), daemon=True)
        runner.start()
        wait_for("one run to start", lambda: list(marker.glob("*-start-1")), timeout=120)
        with cluster.client() as client:
            wait_for("the other to wait in the queue",
                     lambda: client.sync(client.scheduler.gpu_queue_status)["queued"] == 1, timeout=60)
        cluster.start_worker("h100-b", "1 GPU, 80 GB, H100")
        joined = time.monotonic()
        started = wait_for("the waiting run to start on the new worker",
                           lambda: len(list(marker.glob("*-start-1"))) == 2, timeout=90)
        assert started
        names = sorted(f.read_text() for f in marker.glob("*-start-1"))
        assert any('"worker": "h100-b"' in n for n in names) and any('"worker": "h100-a"' in n for n in names), names
        print(f"the waiting run started {time.monotonic() - joined:.1f} s after the new worker was started")
        (marker / "release").write_text("")
        runner.join(60)
        assert out and len(out[0]) == 2
    finally:
        (marker / "release").write_text("")
        cluster.close()
