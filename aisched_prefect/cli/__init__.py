"""The `aisched` command line: run the control plane, operate it, approve runs, read budgets and evidence.

Changes of authority (credentials, applied configuration, delegations,
revocations, approvals) go through the control plane's API with the caller's
credential. Reading the books (budgets, evidence, reports) is done on the
ledger directly, as an auditor with database access would.

This module only wires the command groups together: each group lives in its own
module, the options and helpers they share in `aisched_prefect.cli.common`.
Each command imports what it needs inside its own body: `aisched --help` and a
command that only talks to the control plane load neither Prefect, Dask nor
SQLAlchemy (seconds of start-up each; tests/test_cli_imports.py keeps it so).
"""

from __future__ import annotations

import sys

import typer

from aisched_prefect.cli import approvals, budget, cluster, config, credentials, evidence, grants, report, serve
from aisched_prefect.errors import AISchedError

__all__ = ["app", "main"]

app = typer.Typer(help="aisched-prefect: the control plane, its authority, budgets and evidence.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
app.add_typer(evidence.evidence_app, name="evidence")
app.add_typer(budget.budget_app, name="budget")
app.add_typer(grants.grants_app, name="grants")
app.add_typer(approvals.approvals_app, name="approvals")
app.add_typer(credentials.credentials_app, name="credentials")
# The top-level commands, in the order `aisched --help` lists them (before the groups above).
app.command()(cluster.inventory)
app.command()(evidence.explain)
app.command()(config.apply)
app.command()(cluster.workers)
app.command()(cluster.doctor)
app.command()(serve.serve)
app.command()(approvals.approve)
app.command()(approvals.reject)
app.command()(report.report)
app.command()(cluster.queue)


def main() -> None:
    """`aisched`: every failure is one line naming the fix (with --debug anywhere, the traceback too)."""
    debug = "--debug" in sys.argv
    if debug:
        sys.argv.remove("--debug")
    try:
        code = app(standalone_mode=False)  # click returns an Exit's code instead of raising it here
        sys.exit(code if isinstance(code, int) else 0)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(1)
    except Exception as exc:
        httpx = sys.modules.get("httpx")  # loaded by whichever command talked HTTP; nothing is imported to check
        http_error = httpx is not None and isinstance(exc, httpx.HTTPError)
        if isinstance(exc, (AISchedError, OSError, ValueError)) or http_error:
            if debug:
                raise
            client = sys.modules.get("aisched_prefect.flow.client")
            if client is not None and isinstance(exc, client.ControlPlaneError):
                typer.echo(f"error: the control plane refused (HTTP {exc.status}): {exc}", err=True)
            else:
                typer.echo(f"error: {exc}", err=True)
            sys.exit(2 if http_error or isinstance(exc, OSError) else 1)
        # click's usage errors (typer vendors its own click) print themselves, one line
        show = getattr(exc, "show", None)
        if show is not None and hasattr(exc, "exit_code"):
            show()
            sys.exit(exc.exit_code)
        raise
