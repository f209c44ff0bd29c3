"""Two control-plane replicas on one Postgres serve one flow's runs alternately; one is killed midway.

Every run is admitted once and settled once whichever replica finishes it, the
books balance, and the one evidence chain verifies.
"""

from __future__ import annotations

import shutil
import threading
import time

import pytest
from prefect import flow
from prefect.context import FlowRunContext

from aisched_prefect import AISchedTaskRunner, ai_task
from tests.controlplane import ControlPlaneProcess
from tests.helpers import authority, budget

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api"), pytest.mark.postgres]  # a replica killed


@ai_task(gpus=1, kind="inference", est_seconds=30)
def work(i: int) -> int:
    time.sleep(1.0)
    return i * i


def _replica(tmp_path, name, plane_home, gpu_cluster, postgres_url, operator_token=None) -> ControlPlaneProcess:
    """A replica: the key and TLS files every replica shares (the session workers trust that key), one database."""
    home = tmp_path / name
    home.mkdir()
    shutil.copy(plane_home / "control.key", home / "control.key")
    if operator_token is not None:
        (home / "operator.token").write_text(operator_token)
    return ControlPlaneProcess(home, dask_address=gpu_cluster.scheduler_address, dask_tls=plane_home / "tls",
                               env={"AISCHED_LEDGER_URL": postgres_url, "AISCHED_BODY_LEASE_SECONDS": "5"}).start()


def test_two_replicas_one_killed_midway(tmp_path, plane_home, gpu_cluster, postgres_url):
    a = _replica(tmp_path, "a", plane_home, gpu_cluster, postgres_url)
    b = _replica(tmp_path, "b", plane_home, gpu_cluster, postgres_url, operator_token=a.operator_token)
    try:
        a.apply("authority", "team-a", authority())
        a.apply("budget", "team-a", budget())
        token = a.issue("team-a/nightly", authority="team-a", budget="team-a")
        ledger = b.ledger()
        a_replica = f"-{a.proc.pid}"
        ids: list[str] = []
        killed = threading.Event()

        def kill_a_while_it_runs_a_call() -> None:
            """Once a run is admitted on replica a and not yet settled, kill a (SIGKILL)."""
            deadline = time.time() + 120
            while time.time() < deadline and not killed.is_set():
                if ids:
                    records = ledger.records(ids[0])
                    settled = {r.task_run_id for r in records if r.kind == "settlement"}
                    if any(r.kind == "admission" and r.payload.get("replica", "").endswith(a_replica)
                           and r.task_run_id not in settled for r in records) and len(settled) >= 2:
                        a.kill()
                        killed.set()
                        return
                time.sleep(0.05)

        @flow(task_runner=AISchedTaskRunner(control_plane=f"{a.url},{b.url}", credential=token))
        def alternating() -> list[int]:
            ids.append(str(FlowRunContext.get().flow_run.id))
            return [work(i) for i in range(8)]

        killer = threading.Thread(target=kill_a_while_it_runs_a_call, daemon=True)
        killer.start()
        assert alternating() == [i * i for i in range(8)]
        assert killed.is_set(), "replica a was never caught running a call"
        records = ledger.records(ids[0])
        by_run: dict[str, list[str]] = {}
        for r in records:
            by_run.setdefault(r.task_run_id, []).append(r.kind)
        assert len(by_run) == 8
        for kinds in by_run.values():  # admitted once, settled once, whichever replica finished it
            assert kinds.count("admission") == 1 and kinds.count("settlement") == 1, kinds
        lost = [r for r in records if r.kind == "attempt-lost"]
        assert len(lost) == 1 and lost[0].payload["replica"].endswith(a_replica)
        replicas = {r.payload["replica"] for r in records if r.kind == "admission"}
        assert len(replicas) == 2, "both replicas admitted runs"
        for account in ledger.accounts():
            if account["budget"].startswith("team-a"):
                assert account["pending"] == 0
        settled = sum(s["charged"] for r in records if r.kind == "settlement" for s in r.payload["settlements"]
                      if s["budget"] == "team-a")
        (team,) = [x for x in ledger.accounts() if x["budget"] == "team-a"]
        assert team["posted"] == pytest.approx(settled, abs=1e-6)
        assert ledger.verify().ok
    finally:
        a.stop()
        b.stop()
