"""Authority-chain opacity, tried: after the fact, every run's chain, approver and cost must be visible and verifiable."""

from __future__ import annotations

import pytest
from prefect import flow
from typer.testing import CliRunner

from aisched_prefect import Ledger
from aisched_prefect.cli import app
from aisched_prefect.grants import delegate_grant, revoke_grant
from blocks import AuthorityBlock
from tests.authority_helpers import ROOT, infer, outcome, train
from tests.helpers import runner

pytestmark = pytest.mark.usefixtures("prefect_api")


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


def test_cli_adds_root_grants_to_the_block():
    cli = CliRunner()
    args = ["grants", "add-root", "--authority", "cli-roots", "--id", "ops-root", "--principal", "ops/*",
            "--kinds", "training,inference", "--max-gpus", "8", "--max-cost", "40", "--can-delegate"]
    AuthorityBlock(grants=[]).save("cli-roots", overwrite=True)
    assert cli.invoke(app, args).exit_code == 0
    again = cli.invoke(app, args)
    assert again.exit_code == 1 and "already has a grant 'ops-root'" in again.stdout
    (grant,) = AuthorityBlock.load("cli-roots").grants
    assert grant.kinds == ["training", "inference"] and grant.max_gpus == 8 and grant.can_delegate
