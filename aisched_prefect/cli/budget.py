"""`aisched budget` (show, history): budget accounts, holds and charges in the ledger."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Optional

import typer

from aisched_prefect.cli import common
from aisched_prefect.cli.common import LedgerOpt, console


budget_app = typer.Typer(help="Budget accounts in the ledger.", no_args_is_help=True)


@budget_app.command("show")
def budget_show(
    budget: Optional[str] = typer.Option(None, "--budget", help="Only this budget and the limits under it."),
    as_json: bool = typer.Option(False, "--json", help="JSON lines instead of a table."),
    ledger: Optional[str] = LedgerOpt,
) -> None:
    """Limit, posted, pending and remaining for each budget account and period (expiring run-out holds first)."""
    book = common.Ledger(ledger)
    expired = book.expire_holds()  # a hold whose lease ran out is spent money: show it as such
    rows = [r for r in book.accounts() if budget is None or r["budget"] == budget or r["budget"].startswith(budget + "/")]
    for r in rows:
        r["used"] = f"{(r['posted'] + r['pending']) / r['limit']:.0%}" if r["limit"] else "-"
    if as_json:
        for r in rows:
            typer.echo(json.dumps(r, sort_keys=True))
        return
    console.print(common.table("budgets", rows, ["budget", "period", "unit", "limit", "posted", "pending", "remaining", "used"]))
    if expired:
        console.print(f"{len(expired)} hold(s) whose lease ran out were expired and charged in full")


@budget_app.command("history")
def budget_history(
    budget: Optional[str] = typer.Option(None, "--budget", help="Only this budget and the limits under it."),
    task_run: Optional[str] = typer.Option(None, "--task-run", help="Only the holds of this task run."),
    limit: int = typer.Option(50, "--limit", min=1, help="Newest this many holds."),
    as_json: bool = typer.Option(False, "--json", help="JSON lines instead of a table."),
    ledger: Optional[str] = LedgerOpt,
) -> None:
    """Holds and charges, newest first, with the task runs they belong to."""
    rows = common.Ledger(ledger).history(budget, task_run_id=task_run, limit=limit)
    if as_json:
        for r in rows:
            typer.echo(json.dumps(r, sort_keys=True))
        return
    for r in rows:
        r["created"] = datetime.fromtimestamp(r["created_at"]).strftime("%m-%d %H:%M:%S")
    console.print(common.table("holds and charges", rows, ["created", "budget", "period", "unit", "status", "reserved",
                                                            "charged", "task_run_id", "principal"]))
