"""`aisched report`: GPU-hours, tokens and money of settled AI runs, against every budget."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from aisched_prefect.cli import common
from aisched_prefect.cli.common import LedgerOpt, console


def _flow_names_from_prefect(flow_run_ids: set[str]) -> dict[str, str]:
    """Flow names from the Prefect API, only where one is configured (no temporary server for a report)."""
    from prefect.settings import PREFECT_API_URL

    if not flow_run_ids or not PREFECT_API_URL.value():
        return {}
    from prefect.client.orchestration import get_client

    from aisched_prefect.reports.usage import prefect_flow_names

    try:
        with get_client(sync_client=True) as client:
            return prefect_flow_names(client, flow_run_ids)
    except Exception as exc:  # the report stands without names
        typer.echo(f"note: flow names could not be read from the Prefect API ({exc})", err=True)
        return {}


def report(
    by: str = typer.Option("tenant", "--by", help="Group by tenant, principal, flow, model, gpu-type, kind (warm-idle: warm bodies' idle time) or day."),
    since: Optional[str] = typer.Option(None, "--since", help="Runs settled from then on: YYYY-MM-DD or ISO 8601 (UTC)."),
    until: Optional[str] = typer.Option(None, "--until", help="Runs settled before then; a bare date includes that day."),
    flow_run: Optional[str] = typer.Option(None, "--flow-run", help="Only the AI runs of this flow run."),
    csv_out: Optional[str] = typer.Option(None, "--csv", help="One line per run as CSV, to FILE or - (standard output)."),
    as_json: bool = typer.Option(False, "--json", help="JSON lines (records: run, group, total, budget) instead of tables."),
    plot: Optional[str] = typer.Option(None, "--plot", help="PNG of cumulative spend per group (needs matplotlib: pip install '.[report]')."),
    ledger: Optional[str] = LedgerOpt,
) -> None:
    """GPU-hours, tokens and money of settled AI runs by group, against every budget; money to the cent."""
    from aisched_prefect.reports.usage import (
        InvalidReportOption, PlotUnavailable, budget_table, build_report, check_by, group_table, json_lines,
        parse_when, plot_spend, write_csv,
    )

    try:
        check_by(by)
        start, end = parse_when(since, "--since"), parse_when(until, "--until", end=True)
        book = common.Ledger(ledger)
        expired = book.expire_holds()  # a hold whose lease ran out is spent money: report it as such
        usage = build_report(book, by=by, since=start, until=end, flow_run_id=flow_run,
                             flow_lookup=_flow_names_from_prefect)
    except InvalidReportOption as exc:
        raise typer.BadParameter(exc.fix, param_hint=f"'{exc.option}' (got {exc.value!r})") from None
    machine = as_json or csv_out == "-"
    if plot:
        try:
            plot_spend(usage.runs, by, plot)
        except PlotUnavailable as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        typer.echo(f"plot written to {plot}", err=machine)
    if csv_out == "-":
        write_csv(usage.runs, sys.stdout)
        return
    if csv_out:
        with open(csv_out, "w", newline="") as f:
            write_csv(usage.runs, f)
        typer.echo(f"{len(usage.runs)} run(s) written to {csv_out}", err=as_json)
    if as_json:
        for line in json_lines(usage):
            typer.echo(json.dumps(line, sort_keys=True))
        return
    from aisched_prefect.reports.idle_share import IDLE, idle_table, kind_table

    groups = kind_table(usage) if by == "kind" else group_table(usage)
    console.print(common.table(f"AI usage by {by}", groups, [by, "runs", "GPU-hours", "tokens", "money", "uncovered"]))
    if any(r.kind == IDLE for r in usage.runs):  # idle time of warm bodies, beside the work that left them warm
        console.print(common.table("warm bodies' idle time, beside the work it served", idle_table(usage.runs),
                                   ["work kind", "runs", "work money", "idle periods", "idle seconds", "idle money",
                                    "idle share"]))
    console.print(common.table("budgets" + (" touched" if flow_run else ""), budget_table(usage.budgets),
                               ["budget", "period", "unit", "limit", "posted", "held", "remaining", "used", "in report"]))
    console.print("money: what the ledger posted, in each budget block's currency, rounded to the cent for display")
    if expired:
        console.print(f"{len(expired)} hold(s) whose lease ran out were expired and charged in full")
    for b in usage.mismatches():
        console.print(f"[red]budget {b.budget} ({b.period}): the report's runs add up to {b.in_report}, "
                      f"the ledger posted {b.posted}[/red]")
