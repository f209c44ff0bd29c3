"""Delegating and revoking grants: explicit acts, stored in the ledger with their evidence.

Root grants live in the AuthorityBlock (an operator edits them in the Prefect
UI). A delegation produces a child grant for one principal, checked against
its parent's whole chain as it stands now and refused if it would be broader
in any dimension; a revocation (of a root or a delegated grant) cuts every
chain through it from the next admission on.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from aisched_prefect.ledger import Ledger
from blocks import AuthorityBlock, ChainBroken, DelegationRefused, Grant, delegate, resolve_chain


def _roots(authority: str | AuthorityBlock) -> dict[str, Grant]:
    block = AuthorityBlock.load(authority) if isinstance(authority, str) else authority
    return {g.id: g for g in block.grants}


def delegate_grant(parent: str, *, id: str, principal: str, by: str, authority: str | AuthorityBlock,
                   ledger: Ledger | None = None, **dimensions: Any) -> Grant:
    """Delegate from grant `parent` (a root in `authority`, or a delegated grant) to `principal`.

    `authority` is the AuthorityBlock (name or block) at the root of the
    parent's chain: the whole chain is checked, not just the parent.

    `dimensions` narrow the parent's (kinds, models, gpu_types, max_gpus,
    max_cost_per_run, budget_share, expires_at, can_delegate, can_approve);
    anything wider raises DelegationRefused naming the dimension.
    """
    ledger = ledger or Ledger()
    roots, stored = _roots(authority), ledger.delegated_grants()
    try:
        if id in roots or id in stored:
            raise DelegationRefused("id", f"a grant {id!r} already exists: choose another id")
        if parent not in roots and parent not in stored:
            where = f"AuthorityBlock {authority!r}" if isinstance(authority, str) else "the authority given"
            raise DelegationRefused("parent", f"no grant {parent!r} in {where} or among delegated grants")
        chain = resolve_chain(parent, roots, stored, ledger.revoked_ids())
        child = delegate(chain[-1], id=id, principal=principal, **dimensions)
    except (DelegationRefused, ChainBroken) as exc:
        # A refused delegation is a decision too: it leaves its record.
        ledger.record("delegation-refused", {
            "parent": parent, "grant": id, "to": principal, "by": by, "reason": str(exc),
            "dimension": getattr(exc, "dimension", "chain"),
            "asked": {k: v.isoformat() if hasattr(v, "isoformat") else v for k, v in dimensions.items()},
        }, principal=by)
        raise
    ledger.add_grant(child, by=by)
    return child


def revoke_grant(grant_id: str, *, by: str, reason: str, ledger: Ledger | None = None) -> bool:
    """Revoke `grant_id` and, through it, every grant delegated from it. False if it already was."""
    return (ledger or Ledger()).revoke(grant_id, by=by, reason=reason) is not None


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


def authority_map(authority: str | AuthorityBlock, ledger: Ledger | None = None) -> list[AuthorityRow]:
    """Every root and delegated grant with its live chain status, derived from the block and the ledger."""
    ledger = ledger or Ledger()
    roots, stored, revoked = _roots(authority), ledger.delegated_grants(), ledger.revoked_ids()
    rows = []
    for grant in [*roots.values(), *(g for g in stored.values() if g.id not in roots)]:
        try:
            chain, status = [g.id for g in resolve_chain(grant.id, roots, stored, revoked)], "active"
        except ChainBroken as exc:
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
