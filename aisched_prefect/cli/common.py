"""What every `aisched` command group shares: the common options, the control-plane client, the ledger, output."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from aisched_prefect.flow.client import ControlPlaneClient
    from aisched_prefect.ledger import Ledger as LedgerType

console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)  # piped output: no 80-column squeeze

PlaneOpt = typer.Option(None, "--control-plane", help="URL of `aisched serve` (default: AISCHED_CONTROL_PLANE).")
TokenOpt = typer.Option(None, "--token-file", help="File holding your token (default: AISCHED_OPERATOR_TOKEN, "
                        "AISCHED_TOKEN, or AISCHED_HOME/operator.token).")
LedgerOpt = typer.Option(None, "--ledger", help="Ledger URL (default: AISCHED_LEDGER_URL or ~/.aisched/ledger.db).")
ForceOpt = typer.Option(False, "--force", help="Replace an existing key file.")
ApproverOpt = typer.Option(None, "--as", help="With --key: your name in the authority's approver_keys.")
KeyOpt = typer.Option(None, "--key", help="Your private key from `aisched approvals keygen`: signs the answer.")


def plane(url: Optional[str], token_file: Optional[str] = None, *, signed: bool = False) -> "ControlPlaneClient":
    """A client of the control plane with the caller's own token (operator, approver or flow)."""
    from aisched_prefect.flow.client import ControlPlaneClient
    from aisched_prefect.settings import settings

    env = settings()
    urls = [url] if url else env.control_plane_urls()
    if not urls:
        fail("no control plane address", "pass --control-plane URL or set AISCHED_CONTROL_PLANE (what `aisched serve` printed)")
    caller = token(token_file)
    if caller is None and not signed:
        fail("no credential", "set AISCHED_OPERATOR_TOKEN (operators), AISCHED_TOKEN (approvers), or pass --token-file")
    return ControlPlaneClient(urls, caller or "", retry_seconds=3.0)


def token(token_file: Optional[str]) -> Optional[str]:
    """The caller's token: --token-file, AISCHED_OPERATOR_TOKEN, AISCHED_TOKEN, or this host's operator token file."""
    from pathlib import Path

    from aisched_prefect.settings import settings

    env = settings()
    if token_file:
        return Path(token_file).read_text().strip()
    if env.operator_token is not None:
        return env.operator_token.get_secret_value()
    if env.token is not None:
        return env.token.get_secret_value()
    if (env.home / "operator.token").exists():
        return (env.home / "operator.token").read_text().strip()
    return None


def fail(what: str, fix: str, code: int = 1) -> None:
    typer.echo(f"error: {what}. Fix: {fix}", err=True)
    raise typer.Exit(code)


def Ledger(url: Optional[str] = None) -> "LedgerType":  # noqa: N802 - reads as the class it returns
    """The ledger at `url`, imported only by the commands that read the books (SQLAlchemy takes a second to load)."""
    from aisched_prefect.ledger import Ledger as LedgerClass

    return LedgerClass(url)


def table(title: str, rows: list[dict], columns: list[str]) -> Table:
    table = Table(title=title)
    for c in columns:
        table.add_column(c, overflow="fold")  # a narrow terminal wraps values, never cuts them
    for r in rows:
        table.add_row(*("" if r.get(c) is None else str(r.get(c)) for c in columns))
    return table
