"""The `aisched` command line: inspect inventory, budgets and evidence."""

from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from aisched_prefect.ledger import Ledger
from aisched_prefect.report import evidence_rows

app = typer.Typer(help="aisched-prefect: GPU inventory, budgets and the evidence log.", no_args_is_help=True)
evidence_app = typer.Typer(help="The hash-chained evidence log.", no_args_is_help=True)
budget_app = typer.Typer(help="Budget accounts in the ledger.", no_args_is_help=True)
app.add_typer(evidence_app, name="evidence")
app.add_typer(budget_app, name="budget")
console = Console()

LedgerOpt = typer.Option(None, "--ledger", help="Ledger URL (default: AISCHED_LEDGER_URL or ~/.aisched/ledger.db).")


def _table(title: str, rows: list[dict], columns: list[str]) -> Table:
    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*("" if r.get(c) is None else str(r.get(c)) for c in columns))
    return table


@app.command()
def inventory(declared: Optional[str] = typer.Option(None, help="Declared inventory, e.g. '2 GPUs, 80 GB, H100'.")) -> None:
    """Show the GPUs this host would advertise as a Dask worker."""
    from dask_gpu import discover

    inv = discover(declared)
    console.print(f"source: {inv.source}; {inv.describe()}")
    console.print(_table("devices", [d.model_dump() for d in inv.devices], ["index", "uuid", "name", "gpu_type", "memory_gb"]))


@evidence_app.command("verify")
def evidence_verify(ledger: Optional[str] = LedgerOpt) -> None:
    """Check the whole chain; exit 1 on any edit, deletion, reordering or truncation."""
    report = Ledger(ledger).verify()
    if report.ok:
        console.print(f"[green]evidence chain intact[/green]: {report.records} records")
        return
    console.print(f"[red]evidence chain broken[/red] at record {report.at_seq}: {report.problem}")
    raise typer.Exit(1)


@evidence_app.command("show")
def evidence_show(flow_run: Optional[str] = typer.Option(None, help="Only this flow run's task runs."),
                  ledger: Optional[str] = LedgerOpt) -> None:
    """One row per AI task run: request, principal, grant, placement, reserved, charged, decision."""
    rows = evidence_rows(Ledger(ledger).records(flow_run))
    console.print(_table("AI task runs", rows, ["task", "principal", "request", "grant", "worker", "devices",
                                                "reserved", "charged", "decision"]))


@budget_app.command("show")
def budget_show(ledger: Optional[str] = LedgerOpt) -> None:
    """Limit, posted, pending and remaining for each budget and period."""
    rows = Ledger(ledger).accounts()
    console.print(_table("budgets", rows, ["budget", "period", "limit", "posted", "pending", "remaining"]))


if __name__ == "__main__":  # pragma: no cover
    app()
