"""Non-revocable grants, tried: revocation must reach new, waiting, queued and running work, from any process."""

from __future__ import annotations

import pytest
from prefect import flow

from aisched_prefect import Ledger, ai_task
from aisched_prefect.grants import delegate_grant, revoke_grant
from blocks import AuthorityBlock, Grant
from tests.authority_helpers import ROOT, infer, outcome
from tests.helpers import runner

pytestmark = pytest.mark.usefixtures("prefect_api")


def test_revocation_applies_to_the_next_admission_and_cascades(gpu_cluster, sqlite_url):
    ledger = Ledger(sqlite_url)
    delegate_grant("team-a-root", id="mid", principal="team-a/lead", by="alice", authority=ROOT, ledger=ledger,
                   can_delegate=True)
    delegate_grant("mid", id="leaf", principal="team-a/agent", by="team-a/lead", authority=ROOT, ledger=ledger)

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority=ROOT, principal="team-a/agent",
                             grant="leaf"))
    def agent():
        before = outcome(infer, 1)
        revoke_grant("mid", by="alice", reason="lead left the team", ledger=ledger)  # the leaf's parent
        after = outcome(infer, 2)
        return before, after

    before, after = agent()
    assert before == 1
    assert "grant chain of 'leaf' is broken: grant 'mid' is revoked" in after
    kinds = [r.kind for r in ledger.records()]
    assert kinds.count("revocation") == 1 and kinds[-1] == "denial"


@pytest.mark.parametrize("how, revoker", [("subprocess", "api"), ("checkpoint", "api"), ("subprocess", "cli")])
def test_revocation_stops_a_running_task_within_seconds(gpu_cluster, sqlite_url, tmp_path, how, revoker):
    import sys
    import threading
    import time
    from pathlib import Path

    from dask_gpu import checkpoint, run_subprocess

    ledger = Ledger(sqlite_url)
    delegate_grant("team-a-root", id="runner-grant", principal="team-a/trainer", by="alice", authority=ROOT, ledger=ledger)
    started = tmp_path / "started"

    @ai_task(gpus=1, kind="training", est_seconds=600)
    def long_job(started_path: str, how: str):
        Path(started_path).write_text("x")
        if how == "subprocess":  # a trainer process: killed by the helper
            run_subprocess([sys.executable, "-c", "import time; time.sleep(120)"], check=True)
        else:  # Python code: stops at its next checkpoint
            for _ in range(1200):
                time.sleep(0.1)
                checkpoint()
        return "finished"

    revoked_at: list[float] = []

    def revoke_when_running():
        deadline = time.time() + 60
        while not started.exists() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        revoked_at.append(time.time())
        if revoker == "api":
            revoke_grant("runner-grant", by="alice", reason="incident", ledger=ledger)
        else:  # an operator in another process
            import os
            import subprocess

            cli = os.path.join(os.path.dirname(sys.executable), "aisched")
            subprocess.run([cli, "grants", "revoke", "runner-grant", "--by", "alice", "--reason", "incident",
                            "--ledger", sqlite_url], check=True, capture_output=True)
            revoked_at[0] = next(r.ts for r in ledger.records() if r.kind == "revocation")

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority=ROOT, principal="team-a/trainer",
                             grant="runner-grant"))
    def training():
        return outcome(long_job, str(started), how)

    revoking = threading.Thread(target=revoke_when_running)
    revoking.start()
    result = training()
    revoking.join()
    assert result.startswith("denied: denied at revocation") and "was stopped after" in result
    settlement = [r for r in ledger.records() if r.kind == "settlement"][-1]
    assert settlement.payload["outcome"] == "stopped-revoked"
    revoke_to_stop = settlement.ts - revoked_at[0]
    print(f"revoke-to-stop ({how}, revoked via {revoker}): {revoke_to_stop:.2f} s")
    assert revoke_to_stop < 5.0
    assert ledger.accounts()[0]["pending"] == 0 and ledger.verify().ok


@pytest.mark.parametrize("how", ["expiry", "block-edit"])
def test_expiry_and_a_block_edit_stop_running_work_like_revocation(gpu_cluster, sqlite_url, how):
    import sys
    import time
    from datetime import datetime, timedelta, timezone

    from dask_gpu import run_subprocess

    ledger = Ledger(sqlite_url)
    block_name = f"edit-me-{how}"
    root = Grant(id="edit-root", principal="team-a/*", max_gpus=4, max_cost_per_run=10, can_delegate=True)
    AuthorityBlock(grants=[root]).save(block_name, overwrite=True)
    expires = datetime.now(timezone.utc) + timedelta(seconds=6) if how == "expiry" else None
    delegate_grant("edit-root", id="short", principal="team-a/trainer", by="alice", authority=block_name,
                   ledger=ledger, expires_at=expires)

    @ai_task(gpus=1, kind="training", est_seconds=600)
    def long_job():
        run_subprocess([sys.executable, "-c", "import time; time.sleep(120)"], check=True)

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority=block_name,
                             principal="team-a/trainer", grant="short"))
    def training():
        if how == "block-edit":  # an operator ticks 'revoked' on the root grant in the UI a moment later
            import threading

            revoked = AuthorityBlock(grants=[root.model_copy(update={"revoked": True})])
            threading.Timer(2.0, lambda: revoked.save(block_name, overwrite=True)).start()
        return outcome(long_job)

    t0 = time.time()
    result = training()
    assert result.startswith("denied: denied at revocation")
    assert time.time() - t0 < 30  # 6 s to expiry, or 2 s + the 5 s block refresh, plus one poll


def test_a_burst_of_admissions_after_revocation_is_denied_every_time(gpu_cluster, sqlite_url):
    ledger = Ledger(sqlite_url)
    delegate_grant("team-a-root", id="burst", principal="team-a/burst", by="alice", authority=ROOT, ledger=ledger)

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority=ROOT, principal="team-a/burst",
                             grant="burst"))
    def f():
        first = outcome(infer, -1)
        revoke_grant("burst", by="alice", reason="burst test", ledger=ledger)
        states = infer.map(range(8), return_state=True)
        return first, [s.is_failed() for s in states]

    first, failed = f()
    assert first == -1 and failed == [True] * 8
    kinds = [r.kind for r in ledger.records()]
    assert kinds.count("admission") == 1 and kinds.count("denial") == 8


def test_a_task_queued_behind_others_is_stopped_before_it_starts(gpu_cluster, sqlite_url, tmp_path):
    """The only A10 is busy; a second A10 task waits in Dask; its grant is revoked; it never runs."""
    import sys
    import threading
    import time
    from pathlib import Path

    from dask_gpu import run_subprocess

    ledger = Ledger(sqlite_url)
    for gid, who in (("busy", "team-a/busy"), ("queued", "team-a/queued")):
        delegate_grant("team-a-root", id=gid, principal=who, by="alice", authority=ROOT, ledger=ledger)
    started, ran = tmp_path / "busy-started", tmp_path / "queued-ran"

    @ai_task(gpus=1, gpu_type="A10", kind="training", est_seconds=60)
    def on_the_a10(marker: str, seconds: float):
        Path(marker).write_text("x")
        run_subprocess([sys.executable, "-c", f"import time; time.sleep({seconds})"], check=True)
        return "ran"

    def flow_for(grant: str, marker: Path, seconds: float):
        @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority=ROOT,
                                 principal=f"team-a/{grant}", grant=grant))
        def f():
            return outcome(on_the_a10, str(marker), seconds)

        return f

    results: dict[str, str] = {}
    busy = threading.Thread(target=lambda: results.update(busy=flow_for("busy", started, 4.0)()))
    busy.start()
    deadline = time.time() + 60
    while not started.exists() and time.time() < deadline:
        time.sleep(0.05)
    queued = threading.Thread(target=lambda: results.update(queued=flow_for("queued", ran, 0)()))
    queued.start()
    time.sleep(1.5)  # admitted, waiting in Dask for the A10
    revoke_grant("queued", by="alice", reason="pulled", ledger=ledger)
    busy.join()
    queued.join()
    assert results["busy"] == "ran"
    assert not ran.exists()  # the queued task's body never ran
    assert results["queued"].startswith("denied: denied at revocation") and "before the task started" in results["queued"]
    outcomes = [r.payload.get("outcome") for r in ledger.records() if r.kind == "settlement"]
    assert sorted(outcomes) == ["completed", "revoked-while-queued"]
