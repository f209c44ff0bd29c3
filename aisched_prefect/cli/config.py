"""`aisched apply`: make blocks as edited in Prefect the configuration the control plane enforces."""

from __future__ import annotations

from typing import Optional

import typer

from aisched_prefect.cli import common
from aisched_prefect.cli.common import PlaneOpt, TokenOpt, console


def apply(authority: Optional[str] = typer.Option(None, "--authority", help="AuthorityBlock name."),
          budget: Optional[str] = typer.Option(None, "--budget", help="BudgetBlock name."),
          policy: Optional[str] = typer.Option(None, "--policy", help="ApprovalPolicyBlock name."),
          cluster: Optional[str] = typer.Option(None, "--cluster", help="ClusterBlock name."),
          control_plane: Optional[str] = PlaneOpt, token_file: Optional[str] = TokenOpt) -> None:
    """Apply blocks as edited in Prefect: from now on they are what the control plane enforces (operators only).

    An edit of a block in the Prefect UI or API does nothing until an operator applies it: a flow that
    rewrites a block through Prefect's API gains nothing.
    """
    from aisched_prefect.control.authority.state import CONFIG_KINDS, block_body

    chosen = {"authority": authority, "budget": budget, "policy": policy, "cluster": cluster}
    if not any(chosen.values()):
        common.fail("nothing to apply", "name at least one block: --authority, --budget, --policy or --cluster")
    plane = common.plane(control_plane, token_file)
    for kind, name in chosen.items():
        if name is None:
            continue
        try:
            block = CONFIG_KINDS[kind].load(name)
        except ValueError as exc:
            common.fail(f"{kind} block {name!r} could not be loaded from Prefect ({exc})", "create it, or check PREFECT_API_URL")
        out = plane.post(f"/v1/config/{kind}/{name}", block_body(block))
        console.print(f"applied {kind} {name!r}: version {out['version']} ({out['digest'][:12]})")
