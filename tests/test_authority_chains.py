"""Runs act under an explicit chain of grants; delegation, revocation and sub-flows through real flows."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from prefect import flow
from typer.testing import CliRunner

from aisched_prefect import AdmissionDenied, Ledger, NoAdmissionContext, ai_task
from aisched_prefect.cli import app
from aisched_prefect.grants import delegate_grant, revoke_grant
from aisched_prefect.ledger import grants as grants_table
from blocks import AuthorityBlock, DelegationRefused, Grant
from tests.helpers import runner

pytestmark = pytest.mark.usefixtures("prefect_api")

ROOT = AuthorityBlock(grants=[Grant(id="team-a-root", principal="team-a/*", max_gpus=4, max_cost_per_run=10,
                                    can_delegate=True)])


@ai_task(gpus=1, kind="inference", est_seconds=5)
def infer(i):
    return i


@ai_task(gpus=2, kind="training", est_seconds=20)
def train():
    return "trained"


def outcome(ai, *args):
    try:
        return ai(*args)
    except AdmissionDenied as exc:
        return f"denied: {exc}"


def test_a_delegated_chain_authorizes_and_is_recorded(gpu_cluster, sqlite_url):
    ledger = Ledger(sqlite_url)
    delegate_grant("team-a-root", id="nightly-infer", principal="team-a/nightly", by="alice", authority=ROOT,
                   ledger=ledger, kinds=["inference"], max_gpus=1, can_delegate=True)
    delegate_grant("nightly-infer", id="agent-1", principal="team-a/agent-1", by="team-a/nightly", authority=ROOT,
                   ledger=ledger,
                   max_cost_per_run=1.0)

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority=ROOT, principal="team-a/agent-1",
                             grant="agent-1"))
    def agent():
        return outcome(infer, 1), outcome(train)

    inferred, trained = agent()
    assert inferred == 1
    assert trained.startswith("denied: denied at authority") and "kinds ['inference']" in trained
    admission = next(r for r in ledger.records() if r.kind == "admission")
    assert admission.payload["chain"] == ["team-a-root", "nightly-infer", "agent-1"]
    assert set(admission.payload["grant_versions"]) == {"team-a-root", "nightly-infer", "agent-1"}
    assert [r.kind for r in ledger.records()][:2] == ["delegation", "delegation"]


def test_delegation_wider_than_its_parent_is_refused(sqlite_url):
    ledger = Ledger(sqlite_url)
    with pytest.raises(DelegationRefused, match=r"\(max_gpus\)"):
        delegate_grant("team-a-root", id="wide", principal="team-a/x", by="alice", authority=ROOT, ledger=ledger,
                       max_gpus=8)
    delegate_grant("team-a-root", id="narrow", principal="team-a/x", by="alice", authority=ROOT, ledger=ledger,
                   max_gpus=1)
    with pytest.raises(DelegationRefused, match=r"\(can_delegate\)"):  # narrow was not given the right to delegate
        delegate_grant("narrow", id="deeper", principal="team-a/y", by="team-a/x", authority=ROOT, ledger=ledger)
    assert [r.kind for r in ledger.records()] == ["delegation-refused", "delegation", "delegation-refused"]


def test_a_grant_for_someone_else_does_not_authorize(gpu_cluster, sqlite_url):
    ledger = Ledger(sqlite_url)
    delegate_grant("team-a-root", id="for-bob", principal="team-a/bob", by="alice", authority=ROOT, ledger=ledger)

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority=ROOT, principal="team-a/mallory",
                             grant="for-bob"))
    def mallory():
        return outcome(infer, 1)

    assert "is for 'team-a/bob', not for principal 'team-a/mallory'" in mallory()


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


def test_a_stored_grant_widened_after_the_fact_breaks_its_chain(gpu_cluster, sqlite_url):
    ledger = Ledger(sqlite_url)
    delegate_grant("team-a-root", id="small", principal="team-a/x", by="alice", authority=ROOT, ledger=ledger,
                   max_gpus=1)
    widened = Grant(id="small", principal="team-a/x", parent="team-a-root", max_gpus=64, max_cost_per_run=10)
    with ledger.engine.begin() as conn:  # someone edits the ledger directly
        conn.execute(sa.update(grants_table).where(grants_table.c.id == "small").values(body=widened.model_dump(mode="json")))

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority=ROOT, principal="team-a/x",
                             grant="small"))
    def f():
        return outcome(infer, 1)

    assert "'small' is wider than its parent 'team-a-root' in max_gpus" in f()


def test_a_sub_flow_inherits_nothing_from_its_parent(gpu_cluster, sqlite_url):
    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority=ROOT, principal="team-b/helper"))
    def helper_with_own_runner():
        return outcome(infer, 1)

    @flow  # no AISchedTaskRunner of its own
    def helper_without_runner():
        try:
            return infer(1)
        except NoAdmissionContext as exc:
            return f"refused: {exc}"

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority=ROOT, principal="team-a/boss"))
    def parent():
        return outcome(infer, 0), helper_with_own_runner(), helper_without_runner()

    mine, sub_with_runner, sub_without = parent()
    assert mine == 0  # the parent's own grant works for the parent
    assert "principal 'team-b/helper' holds no grant" in sub_with_runner
    assert sub_without.startswith("refused:") and "AISchedTaskRunner" in sub_without


def test_cli_delegate_revoke_list(sqlite_url):
    cli = CliRunner()
    ROOT.save("cli-authority", overwrite=True)
    ok = cli.invoke(app, ["grants", "delegate", "team-a-root", "--id", "c1", "--to", "team-a/nightly", "--by", "alice",
                          "--authority", "cli-authority", "--kinds", "inference", "--max-gpus", "1", "--ledger", sqlite_url])
    assert ok.exit_code == 0, ok.stdout
    wide = cli.invoke(app, ["grants", "delegate", "team-a-root", "--id", "c2", "--to", "team-a/x", "--by", "alice",
                            "--authority", "cli-authority", "--max-gpus", "16", "--ledger", sqlite_url])
    assert wide.exit_code == 1 and "(max_gpus)" in wide.stdout
    assert cli.invoke(app, ["grants", "revoke", "c1", "--by", "alice", "--reason", "done", "--ledger", sqlite_url]).exit_code == 0
    listed = cli.invoke(app, ["grants", "list", "--ledger", sqlite_url])
    assert "c1" in listed.stdout and "True" in listed.stdout


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


def test_authority_map_explain_and_export(gpu_cluster, sqlite_url, tmp_path):
    import json

    from aisched_prefect.grants import authority_map, to_dot

    ledger = Ledger(sqlite_url)
    delegate_grant("team-a-root", id="lead", principal="team-a/lead", by="alice", authority=ROOT, ledger=ledger,
                   can_delegate=True, max_gpus=2)
    delegate_grant("lead", id="agent", principal="team-a/agent", by="team-a/lead", authority=ROOT, ledger=ledger,
                   kinds=["inference"], max_gpus=1)
    revoke_grant("lead", by="alice", reason="audit", ledger=ledger)
    rows = {r.grant: r for r in authority_map(ROOT, ledger)}
    assert rows["team-a-root"].status == "active" and rows["team-a-root"].chain == "team-a-root"
    assert rows["agent"].status == "broken: grant 'lead' is revoked" and rows["agent"].principal == "team-a/agent"
    dot = to_dot(list(rows.values()))
    assert '"lead" -> "agent"' in dot and "color=red" in dot

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority=ROOT, principal="team-a/agent",
                             grant="agent"))
    def f():
        return outcome(infer, 1)

    f()
    denial = ledger.records()[-1]
    cli = CliRunner()
    explained = cli.invoke(app, ["explain", denial.task_run_id, "--ledger", sqlite_url])
    assert explained.exit_code == 0
    assert "DENIED at authority: grant chain of 'agent' is broken: grant 'lead' is revoked" in explained.stdout
    out = tmp_path / "evidence.jsonl"
    assert cli.invoke(app, ["evidence", "export", "--out", str(out), "--ledger", sqlite_url]).exit_code == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [l["kind"] for l in lines] == ["delegation", "delegation", "revocation", "denial"]
    assert all(l["schema"] == "aisched.evidence/1" for l in lines)
    assert [l["seq"] for l in lines] == [1, 2, 3, 4]


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
