import time

from typer.testing import CliRunner

from aisched_prefect import Ledger
from aisched_prefect.cli import app
from aisched_prefect.ledger import BudgetLine

runner = CliRunner()


def test_inventory_shows_declared_devices():
    out = runner.invoke(app, ["inventory", "--declared", "2 GPUs, 24 GB, A10"])
    assert out.exit_code == 0 and "2 x A10 24 GB" in out.stdout


def test_evidence_verify_and_budget_show(sqlite_url):
    ledger = Ledger(sqlite_url)
    ledger.reserve([BudgetLine(budget="team-a", period="2026-11", limit=5)], 1.0, kind="admission",
                   payload={"task": "train", "request": {"kind": "training"}}, flow_run_id="f", task_run_id="t", principal="p")
    ok = runner.invoke(app, ["evidence", "verify", "--ledger", sqlite_url])
    assert ok.exit_code == 0 and "intact" in ok.stdout
    shown = runner.invoke(app, ["budget", "show", "--ledger", sqlite_url])
    assert shown.exit_code == 0 and "team-a" in shown.stdout
    with ledger.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE aisched_evidence SET principal = 'x'")
    broken = runner.invoke(app, ["evidence", "verify", "--ledger", sqlite_url])
    assert broken.exit_code == 1 and "broken" in broken.stdout


def test_budget_show_and_history(sqlite_url):
    import json
    import time

    ledger = Ledger(sqlite_url, lease_seconds=0.1)
    ids = {"flow_run_id": "f", "principal": "team-a/x"}
    line = BudgetLine(budget="org", period="2026-11", limit=10, amount=2.0)
    done, _ = ledger.reserve([line, BudgetLine(budget="org/team-a", period="2026-11", limit=5, amount=2.0)],
                             kind="admission", payload={}, task_run_id="t-done", **ids)
    ledger.settle([h.id for h in done], 1.5, kind="settlement", payload={}, task_run_id="t-done", **ids)
    ledger.reserve([line], kind="admission", payload={}, task_run_id="t-lost", **ids)  # its process "dies"
    time.sleep(0.2)
    shown = runner.invoke(app, ["budget", "show", "--ledger", sqlite_url, "--json"])
    assert shown.exit_code == 0
    rows = {r["budget"]: r for r in map(json.loads, shown.stdout.splitlines())}
    assert rows["org"]["posted"] == 3.5 and rows["org"]["pending"] == 0 and rows["org"]["used"] == "35%"
    assert rows["org/team-a"]["posted"] == 1.5 and rows["org/team-a"]["remaining"] == 3.5
    table = runner.invoke(app, ["budget", "show", "--ledger", sqlite_url, "--budget", "org"])
    assert table.exit_code == 0 and "org/team-a" in table.stdout and "remaining" in table.stdout
    history = runner.invoke(app, ["budget", "history", "--ledger", sqlite_url, "--budget", "org", "--json"])
    got = [(r["task_run_id"], r["budget"], r["status"], r["charged"]) for r in map(json.loads, history.stdout.splitlines())]
    assert ("t-lost", "org", "expired", 2.0) in got and ("t-done", "org", "posted", 1.5) in got
    one = runner.invoke(app, ["budget", "history", "--ledger", sqlite_url, "--task-run", "t-done"])
    assert one.exit_code == 0 and "t-done" in one.stdout and "t-lost" not in one.stdout


def test_keys_are_private_and_never_replaced_silently(tmp_path):
    import os
    import stat

    for group in ("approvals",):  # checkpoints are signed with the control plane's own key: no other keygen
        key = tmp_path / f"{group}.pem"
        first = runner.invoke(app, [group, "keygen", "--out", str(key)])
        assert first.exit_code == 0, first.output
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
        before = key.read_bytes()
        again = runner.invoke(app, [group, "keygen", "--out", str(key)])
        assert again.exit_code == 1 and "already exists" in again.output and "--force" in again.output
        assert key.read_bytes() == before
        forced = runner.invoke(app, [group, "keygen", "--out", str(key), "--force"])
        assert forced.exit_code == 0 and key.read_bytes() != before
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600


def test_verify_against_a_published_checkpoint_fails_where_none_was_published(sqlite_url, tmp_path):
    ledger = Ledger(sqlite_url)
    ledger.record("note", {"x": 1})
    empty = tmp_path / "checkpoints"
    empty.mkdir()
    missing = runner.invoke(app, ["evidence", "verify", "--ledger", sqlite_url, "--checkpoint", str(empty),
                                  "--public-key", "00" * 32])
    assert missing.exit_code == 1 and "none was found" in missing.stdout


def test_operator_commands_name_the_setting_when_no_control_plane_is_configured(monkeypatch):
    monkeypatch.delenv("AISCHED_CONTROL_PLANE", raising=False)
    out = runner.invoke(app, ["credentials", "issue", "team-a/nightly"])
    assert out.exit_code == 1 and "AISCHED_CONTROL_PLANE" in out.output and "Traceback" not in out.output


def test_operator_issues_applies_and_delegates_through_the_control_plane(control_plane, tmp_path, monkeypatch):
    """What an operator types: credentials, apply from Prefect blocks, and a holder's delegation."""
    import uuid

    from tests.helpers import authority, budget

    name = f"cli-{uuid.uuid4().hex[:6]}"
    authority(can_delegate=True).save(name, overwrite=True)
    budget().save(name, overwrite=True)
    monkeypatch.setenv("AISCHED_CONTROL_PLANE", control_plane.url)
    monkeypatch.setenv("AISCHED_OPERATOR_TOKEN", control_plane.operator_token)
    applied = runner.invoke(app, ["apply", "--authority", name, "--budget", name])
    assert applied.exit_code == 0 and "applied authority" in applied.output and "version 1" in applied.output, applied.output
    again = runner.invoke(app, ["apply", "--authority", name])
    assert "version 1" in again.output  # the same content is not a new version
    token_file = tmp_path / "flow.token"
    issued = runner.invoke(app, ["credentials", "issue", "team-a/nightly", "--authority", name, "--budget", name,
                                 "--out", str(token_file)])
    assert issued.exit_code == 0 and token_file.read_text().startswith("ais_")
    # The holder of team-a-root delegates a narrower grant with its own credential; a wider one is refused.
    ok = runner.invoke(app, ["grants", "delegate", "team-a-root", "--id", f"{name}-child", "--to", "team-a/child",
                             "--max-gpus", "1", "--token-file", str(token_file)])
    assert ok.exit_code == 0, ok.output
    from aisched_prefect.flow.client import ControlPlaneError

    wider = runner.invoke(app, ["grants", "delegate", "team-a-root", "--id", f"{name}-wide", "--to", "team-a/child",
                                "--max-gpus", "64", "--token-file", str(token_file)])
    assert isinstance(wider.exception, ControlPlaneError) and "max_gpus" in str(wider.exception)


def test_a_credential_issued_with_an_expiry_proves_nothing_after_it(control_plane, monkeypatch):
    """`aisched credentials issue ... --expires-in 30d`: the token works until then, and is refused after it naming
    the fix; an expiry that is not a duration, or not positive, is refused at issue and nothing is issued."""
    monkeypatch.setenv("AISCHED_CONTROL_PLANE", control_plane.url)
    monkeypatch.setenv("AISCHED_OPERATOR_TOKEN", control_plane.operator_token)
    month = runner.invoke(app, ["credentials", "issue", "team-a/expiring", "--expires-in", "30d"])
    assert month.exit_code == 0, month.output
    who = control_plane.request("GET", "/v1/whoami", month.output.strip())
    assert who.status_code == 200 and who.json()["expires_at"] > time.time() + 29 * 86400
    gone = control_plane.issue("team-a/expired", expires_in=0.001)  # past its expiry by the time it is used
    refused = control_plane.request("GET", "/v1/whoami", gone)
    assert refused.status_code == 401 and "expired at" in refused.text and "aisched credentials issue" in refused.text
    bad = runner.invoke(app, ["credentials", "issue", "team-a/x", "--expires-in", "soon"])
    assert bad.exit_code != 0 and "'soon' is not a duration" in bad.output
    negative = runner.invoke(app, ["credentials", "issue", "team-a/x", "--expires-in", "-5d"])
    assert negative.exit_code != 0 and "expires_in=-432000.0" in str(negative.exception), negative.exception
    assert "Fix: --expires-in 30d" in str(negative.exception)
