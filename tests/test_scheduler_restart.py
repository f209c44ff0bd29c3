"""The Dask scheduler down for longer than Dask's own reconnect window (30 s), then back on its address.

The control plane keeps reconnecting by itself, says while it is gone that the scheduler is lost (health 503,
naming it), refuses a call made meanwhile with a denial naming it (recorded), is green again within 5 s of the
scheduler's return however long it was gone, and installs the queue again; the attempt the scheduler died under fails with a reason
naming the lost scheduler and is charged for the time it had, and Prefect's retry completes. Each attempt is one
admission and one settlement in the evidence.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from prefect import flow

from aisched_prefect import ai_task
from tests.clusterprocs import ClusterProcs
from tests.helpers import tenant

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api")]

DOWN_SECONDS = 40.0  # past Dask's 30 s: a plain distributed.Client has closed for good by then
plane_inventory_ttl = 5.0  # AISCHED_INVENTORY_TTL_SECONDS's default


def test_the_plane_reconnects_to_a_scheduler_that_was_down_past_dasks_window(tmp_path):
    procs = ClusterProcs(tmp_path)
    started = tmp_path / "started"
    try:
        address = procs.start_scheduler()
        port = int(address.rsplit(":", 1)[1])
        procs.start_worker("gpu-a", "2 GPUs, 80 GB, H100")
        procs.wait_for_workers(1)
        plane = procs.start_plane()
        t = tenant(plane)

        @ai_task(gpus=1, gpu_type="H100", kind="inference", est_seconds=30, retries=1,
                 retry_delay_seconds=DOWN_SECONDS + 15)
        def step(path: str) -> str:
            from pathlib import Path

            first = not Path(path).exists()
            Path(path).write_text("x")
            if first:
                time.sleep(60)  # the scheduler dies under this attempt
            return "done"

        @flow(task_runner=t.runner())
        def survives() -> str:
            return step(str(started))

        @ai_task(gpus=1, gpu_type="H100", kind="inference", est_seconds=30)
        def quick() -> str:
            return "ran"

        @flow(task_runner=t.runner())
        def during() -> str:
            return quick()

        out: dict = {}
        runner = threading.Thread(target=lambda: out.setdefault("result", survives(return_state=True)))
        runner.start()
        deadline = time.monotonic() + 120
        while not started.exists():
            assert runner.is_alive(), f"the flow ended before its first attempt started: {out.get('result')}"
            assert time.monotonic() < deadline, "the first attempt never started"
            time.sleep(0.1)
        for name in ("scheduler", "gpu-a"):  # the scheduler dies; its workers go with it, as docs/how-to says
            os.killpg(procs.procs[name].pid, signal.SIGKILL)
            procs.procs[name].wait()
        lost_at = time.monotonic()
        while True:  # while it is gone, health says so, naming it
            health = plane.request("GET", "/v1/health", token="")
            if health.status_code == 503:
                break
            assert time.monotonic() - lost_at < 30, health.text
            time.sleep(0.2)
        assert address in health.json()["error"] and "does not answer" in health.json()["error"]
        time.sleep(plane_inventory_ttl + 0.5)  # what the plane read of the workers before is too old to decide on
        refused = during(return_state=True)  # a call made during the outage: refused, named, recorded (no bare 500)
        assert refused.is_failed(), refused
        assert "does not answer" in refused.message and address in refused.message, refused.message
        (denial,) = [r for r in plane.records(str(refused.state_details.flow_run_id)) if r.kind == "denial"]
        assert denial.payload["stage"] == "feasibility" and "does not answer" in denial.payload["reason"]
        time.sleep(max(0.0, DOWN_SECONDS - (time.monotonic() - lost_at)))
        procs.start_scheduler(port)
        back_at = time.monotonic()
        while plane.request("GET", "/v1/health", token="").status_code != 200:  # green within 5 s of its return
            assert time.monotonic() - back_at < 5.0, "health still says the scheduler is lost 5 s after it is back"
            time.sleep(0.1)
        procs.start_worker("gpu-a", "2 GPUs, 80 GB, H100")
        procs.wait_for_workers(1, timeout=120)
        runner.join(timeout=240)
        state = out["result"]
        assert state.is_completed(), state
        assert state.result() == "done"
        assert plane.request("GET", "/v1/health", token="").status_code == 200
        records = plane.records(str(state.state_details.flow_run_id))
        kinds = [r.kind for r in records]
        assert kinds == ["admission", "settlement", "admission", "settlement"], kinds
        lost, done = [r for r in records if r.kind == "settlement"]
        assert lost.payload["outcome"] == "scheduler-lost" and address in lost.payload["error"], lost.payload
        assert 0 < lost.payload["seconds"] < 60  # charged for the time it had, not its whole hold
        assert done.payload["outcome"] == "completed"
    finally:
        procs.close()
