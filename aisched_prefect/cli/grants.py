"""`aisched grants` (add-root, delegate, revoke, map, list): execution authority and its delegations."""

from __future__ import annotations

from datetime import datetime
from typing import Optional

import typer

from aisched_prefect.cli import common
from aisched_prefect.cli.common import LedgerOpt, PlaneOpt, TokenOpt, console


grants_app = typer.Typer(help="Delegate, revoke and list grants.", no_args_is_help=True)


def _names(value: Optional[str]) -> Optional[list[str]]:
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


@grants_app.command("add-root")
def grants_add_root(
    authority: str = typer.Option(..., help="AuthorityBlock to add the root grant to (created if missing)."),
    id: str = typer.Option(..., "--id"),
    principal: str = typer.Option(..., help="One principal (team-a/nightly), or group:NAME of a declared group."),
    kinds: str = typer.Option("*", help="Comma-separated kinds, or *."),
    models: str = typer.Option("*", help="Comma-separated models, or *."),
    gpu_types: str = typer.Option("*", "--gpu-types", help="Comma-separated GPU types, or *."),
    max_gpus: int = typer.Option(..., "--max-gpus"),
    max_cost: float = typer.Option(..., "--max-cost", help="Max cost per run."),
    max_priority: int = typer.Option(0, "--max-priority", help="Highest queue priority its runs may take (0-100)."),
    expires: Optional[datetime] = typer.Option(None, help="Expiry (ISO 8601, UTC unless given)."),
    can_delegate: bool = typer.Option(False, "--can-delegate"),
    can_approve: bool = typer.Option(False, "--can-approve"),
) -> None:
    """Add a root grant to an AuthorityBlock in Prefect (as the UI's editor would); it applies after `aisched apply`."""
    from blocks import AuthorityBlock, Grant

    try:
        block = AuthorityBlock.load(authority)
    except ValueError:
        block = AuthorityBlock()
    if any(g.id == id for g in block.grants):
        common.fail(f"AuthorityBlock {authority!r} already has a grant {id!r}", "choose another --id")
    grant = Grant(id=id, principal=principal, kinds=_names(kinds) or ["*"], models=_names(models) or ["*"],
                  gpu_types=_names(gpu_types) or ["*"], max_gpus=max_gpus, max_cost_per_run=max_cost,
                  max_priority=max_priority, expires_at=expires, can_delegate=can_delegate, can_approve=can_approve)
    updated = block.model_copy(update={"grants": [*block.grants, grant]})
    problems = updated.problems()
    if problems:
        common.fail(problems[0], "name one principal, or declare a group in the block and name group:NAME")
    updated.save(authority, overwrite=True)
    console.print(f"added root grant [bold]{id}[/bold] for {principal} to AuthorityBlock {authority!r}; "
                  f"it takes effect once an operator runs `aisched apply --authority {authority}`")


@grants_app.command("delegate")
def grants_delegate(
    parent: str = typer.Argument(..., help="Id of the grant to delegate from (one you hold, or any as an operator)."),
    id: str = typer.Option(..., "--id", help="Id of the new grant."),
    to: str = typer.Option(..., "--to", help="Principal that receives it, e.g. team-a/nightly."),
    authority: Optional[str] = typer.Option(None, help="Operators: the applied authority the parent is in."),
    kinds: Optional[str] = typer.Option(None, help="Comma-separated kinds, within the parent's."),
    models: Optional[str] = typer.Option(None, help="Comma-separated models, within the parent's."),
    gpu_types: Optional[str] = typer.Option(None, "--gpu-types", help="Comma-separated GPU types, within the parent's."),
    max_gpus: Optional[int] = typer.Option(None, "--max-gpus"),
    max_cost: Optional[float] = typer.Option(None, "--max-cost", help="Max cost per run."),
    budget_share: Optional[float] = typer.Option(None, "--budget-share"),
    max_priority: Optional[int] = typer.Option(None, "--max-priority", help="Highest queue priority, within the parent's."),
    expires: Optional[datetime] = typer.Option(None, help="Expiry (ISO 8601, UTC unless given)."),
    can_delegate: bool = typer.Option(False, "--can-delegate"),
    can_approve: bool = typer.Option(False, "--can-approve"),
    control_plane: Optional[str] = PlaneOpt, token_file: Optional[str] = TokenOpt,
) -> None:
    """Delegate a narrower grant as its holder; anything wider than the parent is refused, naming the dimension."""
    given = {"kinds": _names(kinds), "models": _names(models), "gpu_types": _names(gpu_types), "max_gpus": max_gpus,
             "max_cost_per_run": max_cost, "budget_share": budget_share, "max_priority": max_priority,
             "expires_at": expires.isoformat() if expires else None, "can_delegate": can_delegate or None,
             "can_approve": can_approve or None}
    dims = {k: v for k, v in given.items() if v is not None}
    child = common.plane(control_plane, token_file).post(f"/v1/grants/{parent}/delegate", {
        "id": id, "principal": to, "authority": authority, "dimensions": dims})
    console.print(f"delegated [bold]{child['id']}[/bold] to {child['principal']} from {parent}")


@grants_app.command("revoke")
def grants_revoke(grant_id: str, reason: str = typer.Option(..., "--reason"),
                  authority: Optional[str] = typer.Option(None, help="Operators: the applied authority that holds it."),
                  control_plane: Optional[str] = PlaneOpt, token_file: Optional[str] = TokenOpt) -> None:
    """Revoke a grant and everything delegated from it: new admissions at once, running work within seconds."""
    out = common.plane(control_plane, token_file).post(f"/v1/grants/{grant_id}/revoke",
                                                       {"reason": reason, "authority": authority})
    console.print(f"revoked {grant_id}" if out["revoked"] else f"{grant_id} was already revoked")


@grants_app.command("map")
def grants_map(authority: str = typer.Option(..., help="The applied authority to map."),
               dot: Optional[str] = typer.Option(None, help="Write the graph as DOT here (and a PNG beside it where Graphviz is installed)."),
               ledger: Optional[str] = LedgerOpt) -> None:
    """Who really holds execution authority: every grant of an applied authority and below it, through which chain."""
    from aisched_prefect.grants import authority_map, to_dot

    try:
        rows = authority_map(common.Ledger(ledger), authority)
    except LookupError as exc:
        common.fail(str(exc), f"apply it first: aisched apply --authority {authority}")
    console.print(common.table("effective authority", [r.model_dump() for r in rows],
                               ["principal", "grant", "chain", "status", "kinds", "models", "gpu_types", "max_gpus",
                                "max_cost_per_run", "expires_at", "can_delegate", "can_approve"]))
    if dot:
        import shutil
        import subprocess

        with open(dot, "w") as f:
            f.write(to_dot(rows))
        console.print(f"graph written to {dot}")
        if shutil.which("dot"):
            png = dot.rsplit(".", 1)[0] + ".png"
            subprocess.run(["dot", "-Tpng", dot, "-o", png], check=True)
            console.print(f"picture written to {png}")


@grants_app.command("list")
def grants_list(ledger: Optional[str] = LedgerOpt) -> None:
    """Delegated grants (from the evidence chain) and whether they are revoked."""
    from aisched_prefect.control.authority.state import AuthorityState

    snap = AuthorityState(common.Ledger(ledger)).refresh()
    rows = [{**g.model_dump(), "authority": name, "revoked": (name, g.id) in snap.revoked}
            for (name, _), g in snap.delegated.items()]
    console.print(common.table("delegated grants", rows, ["authority", "id", "parent", "principal", "kinds", "gpu_types", "max_gpus",
                                                          "max_cost_per_run", "expires_at", "can_delegate", "revoked"]))
