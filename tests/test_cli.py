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
