"""The ledger's Postgres gone for 4 s (a restart: connections dropped, new ones refused) while runs finish: every run
whose body finished is reported completed and settled by what it used, and no hold is left to expire charged in
full.

Why: the ledger's own retries add up to under a second; a restart took 2.6-4.8 s, the settlement failed, the run
was reported failed ("could not run it") and its hold was charged in full when its lease ended (issue 31).
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
from prefect import flow
from prefect.context import FlowRunContext

from aisched_prefect import Ledger, ai_task
from tests.controlplane import ControlPlaneProcess
from tests.helpers import CuttingProxy, tenant, wait_until

pytestmark = [pytest.mark.usefixtures("prefect_api"), pytest.mark.postgres]

RUNS = 6
DOWN_SECONDS = 4.0


@ai_task(gpus=1, gpu_type="H100", kind="inference", est_seconds=30)
def gated(i: int, gate: str, marks: str) -> int:
    with open(marks, "a") as f:
        f.write(f"start {i}\n")
    while not Path(gate).exists():
        time.sleep(0.05)
    return i * 10


def test_runs_that_finish_while_the_ledger_restarts_are_reported_completed_and_charged_for_what_ran(
        tmp_path, plane_home, gpu_cluster, postgres_url):
    host_port = postgres_url.split("@", 1)[1].split("/", 1)[0]
    proxy = CuttingProxy(host_port)
    proxied = postgres_url.replace(host_port, proxy.url.removeprefix("http://"), 1)
    home = tmp_path / "plane"
    home.mkdir()
    shutil.copy(plane_home / "control.key", home / "control.key")
    plane = ControlPlaneProcess(home, dask_address=gpu_cluster.scheduler_address, dask_tls=plane_home / "tls",
                                env={"AISCHED_LEDGER_URL": proxied}).start()
    gate, marks = tmp_path / "gate", tmp_path / "marks"
    marks.touch()
    try:
        t = tenant(plane)
        ids: list[str] = []

        @flow(task_runner=t.runner())
        def finishing() -> list:
            ids.append(str(FlowRunContext.get().flow_run.id))
            futures = gated.map(range(RUNS), gate=str(gate), marks=str(marks))
            futures.wait()
            return [f.state for f in futures]

        out: dict = {}
        runner = threading.Thread(target=lambda: out.setdefault("states", finishing()), daemon=True)
        runner.start()
        wait_until(lambda: marks.read_text().count("start") >= 4, 240, "four bodies running at the gate")
        proxy.down(DOWN_SECONDS)  # Postgres restarts ...
        gate.touch()  # ... while the running bodies finish and settle
        runner.join(timeout=300)
        assert not runner.is_alive(), "the flow still waits"
        states = out["states"]
        assert [s.is_completed() for s in states] == [True] * RUNS, [s.message for s in states]
        assert sorted(s.result() for s in states) == [i * 10 for i in range(RUNS)]
        auditor = Ledger(postgres_url)
        try:
            records = auditor.records(ids[0])
            settlements = [r for r in records if r.kind == "settlement"]
            assert len(settlements) == RUNS and {r.payload["outcome"] for r in settlements} == {"completed"}
            charged = sum(s["charged"] for r in settlements for s in r.payload["settlements"] if s["budget"] == t.budget)
            released = sum(s["released"] for r in settlements for s in r.payload["settlements"]
                           if s["budget"] == t.budget)
            assert charged > 0 and released > 0  # by what ran (seconds), the rest of each hold released
            (account,) = [a for a in auditor.accounts() if a["budget"] == t.budget]
            assert account["pending"] == 0 and account["posted"] == pytest.approx(charged, abs=1e-6)
            assert auditor.verify().ok
        finally:
            auditor.close()
    finally:
        plane.stop()
        proxy.close()
