"""The control plane killed (SIGKILL) and started again on its address right after a map was accepted, and a few
seconds later: every run ends once (completed, or failed with a named reason), nothing is left held to be charged
in full for runs that never ran, and the evidence chain verifies.

Why: a plane restarted within a poll's 20 s was taken for the one that accepted the calls; nothing was sent again,
the flow hung and every hold expired charged in full (issue 31). The 25 s case and 1,000 runs: bench/faults.py.
"""

from __future__ import annotations

import shutil
import threading
import time

import pytest
from prefect import flow
from prefect.context import FlowRunContext

from aisched_prefect import ai_task
from tests.controlplane import ControlPlaneProcess
from tests.helpers import tenant, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api")]  # plane outages: minutes each

RUNS = 40


@ai_task(gpus=1, gpu_type="H100", kind="inference", est_seconds=30)
def shard(i: int) -> int:
    time.sleep(0.3)
    return i


@pytest.mark.parametrize("delay", [0.0, 5.0])
def test_a_plane_restarted_after_a_map_was_accepted_ends_every_run_once(tmp_path, plane_home, gpu_cluster, delay):
    home = tmp_path / "plane"
    home.mkdir()
    shutil.copy(plane_home / "control.key", home / "control.key")  # the key the session's workers trust
    plane = ControlPlaneProcess(home, dask_address=gpu_cluster.scheduler_address, dask_tls=plane_home / "tls").start()
    try:
        t = tenant(plane)
        ledger = plane.ledger()
        ids: list[str] = []

        @flow(task_runner=t.runner())
        def mapped() -> list:
            ids.append(str(FlowRunContext.get().flow_run.id))
            futures = shard.map(range(RUNS))
            futures.wait()
            return [f.state for f in futures]

        out: dict = {}
        runner = threading.Thread(target=lambda: out.setdefault("states", mapped()), daemon=True)
        runner.start()
        wait_until(lambda: ids and sum(r.kind == "admission" for r in ledger.records(ids[0])) == RUNS, 180,
                   "the map accepted")
        time.sleep(delay)  # the fault's moment after the map was accepted (the scenario, not a wait for an event)
        port = plane.url.rsplit(":", 1)[1]
        plane.kill()
        plane.args[plane.args.index("--port") + 1] = port  # started again on its address
        plane.start()
        runner.join(timeout=420)
        assert not runner.is_alive(), "the flow still waits: it was stranded by the restart"
        states = out["states"]
        completed = [s for s in states if s.is_completed()]
        failed = [s for s in states if not s.is_completed()]
        for s in failed:  # a failure is named: its one line says why
            assert s.is_failed() and s.message and "Fix" in str(s.result(raise_on_failure=False)), s
        assert sorted(s.result() for s in completed) == sorted(set(s.result() for s in completed))
        assert len(completed) + len(failed) == RUNS
        records = ledger.records(ids[0])
        by_run: dict[str, list[str]] = {}
        for r in records:
            by_run.setdefault(r.task_run_id, []).append(r.kind)
        assert len(by_run) == RUNS
        for kinds in by_run.values():  # admitted once, settled once, whichever life of the plane finished it
            assert kinds.count("admission") == 1 and kinds.count("settlement") == 1, kinds
        outcomes = [r.payload["outcome"] for r in records if r.kind == "settlement"]
        assert outcomes.count("completed") == len(completed), outcomes
        (account,) = [a for a in ledger.accounts() if a["budget"] == t.budget]
        assert account["pending"] == 0  # no hold left to expire, charged in full, for a run that never ran
        charged = sum(s["charged"] for r in records if r.kind == "settlement" for s in r.payload["settlements"]
                      if s["budget"] == t.budget)
        assert account["posted"] == pytest.approx(charged, abs=1e-6)
        assert ledger.verify().ok
    finally:
        plane.stop()
