"""`aisched credentials` (issue, revoke): credentials of flows, approvers and operators."""

from __future__ import annotations

from typing import Optional

import typer

from aisched_prefect.cli import common
from aisched_prefect.cli.common import PlaneOpt, TokenOpt, console


credentials_app = typer.Typer(help="Credentials of flows, approvers and operators.", no_args_is_help=True)


@credentials_app.command("issue")
def credentials_issue(principal: str = typer.Argument(..., help="Who the credential proves, e.g. team-a/nightly."),
                      role: str = typer.Option("flow", help="flow, approver or operator."),
                      tenant: Optional[str] = typer.Option(None, help="Who pays (default: principal up to its '/')."),
                      authority: Optional[str] = typer.Option(None, help="Applied authority it runs under."),
                      budget: Optional[str] = typer.Option(None, help="Applied budget it spends."),
                      policy: Optional[str] = typer.Option(None, help="Applied approval policy."),
                      cluster: Optional[str] = typer.Option(None, help="Applied cluster settings."),
                      out: Optional[str] = typer.Option(None, "--out", help="Write the token here (0600) instead of printing it."),
                      control_plane: Optional[str] = PlaneOpt, token_file: Optional[str] = TokenOpt) -> None:
    """Issue a credential (operators only). The token is shown once; the control plane keeps only its hash."""
    body = {"principal": principal, "role": role, "tenant": tenant, "authority": authority, "budget": budget,
            "policy": policy, "cluster": cluster}
    issued = common.plane(control_plane, token_file).post("/v1/credentials", body)
    if out:
        from pathlib import Path

        from aisched_prefect.control.keys import write_private

        write_private(Path(out), issued["token"].encode(), force=True)
        console.print(f"credential {issued['credential']['id']} for {principal} written to {out}")
    else:
        typer.echo(issued["token"])


@credentials_app.command("revoke")
def credentials_revoke(credential_id: str, control_plane: Optional[str] = PlaneOpt,
                       token_file: Optional[str] = TokenOpt) -> None:
    """Revoke a credential: its holder is refused from the next request, and its running work is stopped."""
    common.plane(control_plane, token_file).post(f"/v1/credentials/{credential_id}/revoke")
    console.print(f"revoked credential {credential_id}")
