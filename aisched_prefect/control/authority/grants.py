"""Grants: delegating authority below an applied authority's grants, and revoking it.

Only a grant's holder (or an operator) delegates from it, within what it allows; only an operator or
a holder of a grant above one revokes it, with everything below it. Each act, and each refused
delegation, is an evidence record that the folded authority state reads back.
"""

from __future__ import annotations

from typing import Any

from aisched_prefect.control.authority import records
from aisched_prefect.control.admission import stages
from aisched_prefect.control.authority.credentials import Unauthorized
from aisched_prefect.control.authority.identity import Credential
from aisched_prefect.control.authority.state import Applied, AuthorityState
from aisched_prefect.errors import AISchedError
from aisched_prefect.ledger import Ledger
from blocks import ChainBroken, DelegationRefused, Grant, delegate


def _roots_in(snap: Any, authority: Applied, grant_id: str) -> bool:
    """Whether `grant_id` was delegated under `authority`."""
    return grant_id in snap.delegated_in(authority)


class Grants:
    """Delegation and revocation of grants, each checked against the authority state as it is now."""

    def __init__(self, ledger: Ledger, state: AuthorityState) -> None:
        self.ledger, self.state = ledger, state

    def delegate(self, caller: Credential, parent: str, *, id: str, principal: str, authority: str | None = None,
                 **dimensions: Any) -> Grant:
        """Delegate from `parent` to `principal`: only a holder of `parent` (or an operator) may.

        A flow's or approver's credential delegates under the authority it is bound to; an
        operator names the authority (`authority=`).
        """
        snap = self.state.refresh()
        name = authority if caller.role == "operator" else caller.authority
        applied = snap.config("authority", name)
        if applied is None:
            raise DelegationRefused("authority", f"no authority {name!r} is applied on this control plane")
        authority_ = applied
        try:
            if id in snap.index(authority_).roots or id in snap.delegated_in(authority_):
                raise DelegationRefused("id", f"a grant {id!r} already exists: choose another id")
            chain = stages.chain_of(snap, authority_, parent)
            if caller.role != "operator" and parent not in {g.id for g in snap.grants_of(authority_, caller.principal)}:
                raise DelegationRefused("by", f"{caller.principal!r} does not hold grant {parent!r}: only its holder "
                                        "(or an operator) may delegate from it")
            child = delegate(chain[-1], id=id, principal=principal, **dimensions)
        except (DelegationRefused, ChainBroken) as exc:
            self.ledger.record("delegation-refused", {
                "parent": parent, "grant": id, "to": principal, "by": caller.principal, "reason": str(exc),
                "dimension": getattr(exc, "dimension", "chain"),
                "asked": {k: v.isoformat() if hasattr(v, "isoformat") else v for k, v in dimensions.items()},
            }, principal=caller.principal)
            raise
        records.record(self.ledger, records.Delegation(grant=child, by=caller.principal, authority=authority_.name),
                       principal=caller.principal)
        self.state.refresh()
        return child

    def revoke(self, caller: Credential, grant_id: str, reason: str, authority: str | None = None) -> bool:
        """Revoke a grant and everything below it: an operator, or the holder of a grant above it, may.

        Grant ids are unique within one authority, so a revocation names its authority: the
        caller's own, or (operators) the one that holds the grant (`authority=` where several do).
        """
        snap = self.state.refresh()
        if caller.role == "operator":
            holders = [a for (k, n), a in snap.configs.items() if k == "authority" and (authority is None or n == authority)
                       and (grant_id in snap.index(a).roots or _roots_in(snap, a, grant_id))]
            if len(holders) != 1:
                raise AISchedError(f"grant {grant_id!r} is in {len(holders)} applied authorities"
                                   f"{' (' + ', '.join(a.name for a in holders) + ')' if holders else ''}. "
                                   "Fix: name one with authority=")
            applied = holders[0]
        else:
            applied = snap.config("authority", caller.authority)
            held = {g.id for g in snap.grants_of(applied, caller.principal)} if applied else set()
            try:
                ancestors = {g.id for g in stages.chain_of(snap, applied, grant_id)[:-1]} if applied else set()
            except ChainBroken:
                ancestors = set()
            if applied is None or not held & ancestors:
                raise Unauthorized(f"{caller.principal!r} holds no grant above {grant_id!r}: only an operator or the "
                                   "grant's delegator may revoke it", 403)
        if (applied.name, grant_id) in snap.revoked:
            return False
        records.record(self.ledger, records.Revocation(grant=grant_id, authority=applied.name, by=caller.principal,
                                                       reason=reason), principal=caller.principal)
        self.state.refresh()
        return True
