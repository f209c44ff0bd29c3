"""Delegating and revoking grants: explicit acts, stored in the ledger with their evidence.

Root grants live in the AuthorityBlock (an operator edits them in the Prefect
UI). A delegation produces a child grant for one principal, checked against
its parent's whole chain as it stands now and refused if it would be broader
in any dimension; a revocation (of a root or a delegated grant) cuts every
chain through it from the next admission on.
"""

from __future__ import annotations

from typing import Any

from aisched_prefect.ledger import Ledger
from blocks import AuthorityBlock, DelegationRefused, Grant, delegate, resolve_chain


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
    if id in roots or id in stored:
        raise DelegationRefused("id", f"a grant {id!r} already exists: choose another id")
    if parent not in roots and parent not in stored:
        where = f"AuthorityBlock {authority!r}" if isinstance(authority, str) else "the authority given"
        raise DelegationRefused("parent", f"no grant {parent!r} in {where} or among delegated grants")
    chain = resolve_chain(parent, roots, stored, ledger.revoked_ids())
    child = delegate(chain[-1], id=id, principal=principal, **dimensions)
    ledger.add_grant(child, by=by)
    return child


def revoke_grant(grant_id: str, *, by: str, reason: str, ledger: Ledger | None = None) -> bool:
    """Revoke `grant_id` and, through it, every grant delegated from it. False if it already was."""
    return (ledger or Ledger()).revoke(grant_id, by=by, reason=reason) is not None
