"""`aisched credentials` (issue, revoke): credentials of flows, approvers and operators."""

from __future__ import annotations

from typing import Optional

import typer

from aisched_prefect.cli import common
from aisched_prefect.cli.common import PlaneOpt, TokenOpt, console


def seconds_of(text: str) -> float:
    """'30d', '12h', '90m', '45s' or a number of seconds, as seconds.

    >>> seconds_of("30d"), seconds_of("12h"), seconds_of("90m"), seconds_of("3600")
    (2592000.0, 43200.0, 5400.0, 3600.0)
    """
    units = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
    value, unit = (text[:-1], units[text[-1]]) if text and text[-1] in units else (text, 1.0)
    try:
        return float(value) * unit
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a duration. Fix: 30d, 12h, 90m or a number of seconds",
                                 param_hint="--expires-in") from None


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
                      expires_in: Optional[str] = typer.Option(
                          None, "--expires-in", help="It proves nothing after this long: 30d, 12h, 90m or seconds "
                          "(default: until revoked)."),
                      control_plane: Optional[str] = PlaneOpt, token_file: Optional[str] = TokenOpt) -> None:
    """Issue a credential (operators only). The token is shown once; the control plane keeps only its hash."""
    body = {"principal": principal, "role": role, "tenant": tenant, "authority": authority, "budget": budget,
            "policy": policy, "cluster": cluster, "expires_in": seconds_of(expires_in) if expires_in else None}
    issued = common.plane(control_plane, token_file).post("/v1/credentials", body)
    if out:
        from pathlib import Path

        from aisched_prefect.control.authority.keys import write_private

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
