"""Who holds what: every grant of an applied authority and below it, with its live chain status.

Read from the evidence chain (applied configuration, delegations, revocations),
as admission reads it: what this shows is what is enforced.
"""

from __future__ import annotations

from pydantic import BaseModel

from aisched_prefect.control.authority.state import AuthorityState
from aisched_prefect.ledger import Ledger
from blocks import ChainBroken, resolve_chain


class AuthorityRow(BaseModel):
    """One grant as it stands now: who holds it, through which chain, what it allows, and whether it works."""

    principal: str
    grant: str
    parent: str | None
    chain: str
    status: str  # "active", or why the chain is broken
    kinds: str
    models: str
    gpu_types: str
    max_gpus: int
    max_cost_per_run: float
    expires_at: str | None
    can_delegate: bool
    can_approve: bool


def authority_map(ledger: Ledger, authority: str) -> list[AuthorityRow]:
    """Every root grant of the applied authority `authority` and every grant delegated below one of them."""
    snap = AuthorityState(ledger).refresh()
    applied = snap.config("authority", authority)
    if applied is None:
        raise LookupError(f"no authority {authority!r} has been applied")
    idx = snap.index(applied)
    rows = []
    delegated = snap.delegated_in(applied)
    for grant in [*idx.roots.values(), *(g for g in delegated.values() if g.id not in idx.roots)]:
        try:
            chain, status = [g.id for g in resolve_chain(grant.id, idx.roots, delegated, snap.revoked_in(applied))], "active"
        except ChainBroken as exc:
            if grant.id not in idx.roots and "does not exist" in str(exc):
                continue  # below another authority's roots
            chain, status = [], f"broken: {exc}"
        rows.append(AuthorityRow(
            principal=grant.principal, grant=grant.id, parent=grant.parent, chain=" -> ".join(chain), status=status,
            kinds=",".join(grant.kinds), models=",".join(grant.models), gpu_types=",".join(grant.gpu_types),
            max_gpus=grant.max_gpus, max_cost_per_run=grant.max_cost_per_run,
            expires_at=grant.expires_at.isoformat() if grant.expires_at else None,
            can_delegate=grant.can_delegate, can_approve=grant.can_approve))
    return sorted(rows, key=lambda r: (r.principal, r.grant))


def to_dot(rows: list[AuthorityRow]) -> str:
    """The delegation graph: one node per grant (red when its chain is broken), edges parent -> child."""
    lines = ["digraph authority {", "  rankdir=LR;", "  node [shape=box, fontname=Helvetica];"]
    for r in rows:
        rights = "".join(f"\\n{right}" for right, held in (("delegates", r.can_delegate), ("approves", r.can_approve)) if held)
        label = f"{r.grant}\\n{r.principal}\\nkinds={r.kinds} gpus<={r.max_gpus} cost<={r.max_cost_per_run:g}{rights}"
        color = "black" if r.status == "active" else "red"
        lines.append(f'  "{r.grant}" [label="{label}", color={color}, fontcolor={color}];')
    for r in rows:
        if r.parent:
            lines.append(f'  "{r.parent}" -> "{r.grant}";')
    lines.append("}")
    return "\n".join(lines) + "\n"
