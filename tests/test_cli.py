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
