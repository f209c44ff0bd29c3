"""Delegation: a child grant is an explicit act, and it is never broader than its parent.

Pure functions on grants. Each dimension narrows independently: kinds, models
and GPU types (a subset; '*' only under '*'), max GPUs, max cost per run,
budget share, max priority, expiry (no later; never 'no expiry' under an expiring parent),
and the rights to delegate further and to approve (only if the parent has
them). Anything wider is refused, naming the dimension.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from blocks.authority import ANY, Grant, utc

_SETS = ("kinds", "models", "gpu_types")
_NUMBERS = ("max_gpus", "max_cost_per_run", "budget_share", "max_priority")
_RIGHTS = ("can_delegate", "can_approve")


class DelegationRefused(ValueError):
    """A delegation that would widen its parent, or that its parent may not make."""

    def __init__(self, dimension: str, message: str) -> None:
        self.dimension = dimension
        super().__init__(f"delegation refused ({dimension}): {message}")


def _set_within(child: list[str], parent: list[str]) -> bool:
    if ANY in parent:
        return True
    return ANY not in child and {c.lower() for c in child} <= {p.lower() for p in parent}


def violations(parent: Grant, child: Grant) -> list[tuple[str, str]]:
    """Every (dimension, reason) in which `child` is broader than `parent`; empty when it only narrows."""
    out: list[tuple[str, str]] = []
    for dim in _SETS:
        if not _set_within(getattr(child, dim), getattr(parent, dim)):
            out.append((dim, f"{getattr(child, dim)} is not within the parent's {getattr(parent, dim)}"))
    for dim in _NUMBERS:
        if getattr(child, dim) > getattr(parent, dim):
            out.append((dim, f"{getattr(child, dim)} is above the parent's {getattr(parent, dim)}"))
    if parent.expires_at is not None and (child.expires_at is None or utc(child.expires_at) > utc(parent.expires_at)):
        out.append(("expires_at", f"{child.expires_at} is later than the parent's {parent.expires_at}"))
    for dim in _RIGHTS:
        if getattr(child, dim) and not getattr(parent, dim):
            out.append((dim, "the parent does not hold this right"))
    return out


def delegate(parent: Grant, *, id: str, principal: str, now: datetime | None = None, **narrowed: Any) -> Grant:
    """A child of `parent` for `principal`; dimensions not given are the parent's, rights default to none.

    Refused (DelegationRefused, naming the dimension) when the parent is revoked,
    expired or may not delegate, when the delegate is a glob of principals, or
    when any dimension would be wider than the parent's.
    """
    now = now or datetime.now(timezone.utc)
    if parent.revoked:
        raise DelegationRefused("revoked", f"grant {parent.id!r} is revoked")
    if parent.expires_at is not None and now >= utc(parent.expires_at):
        raise DelegationRefused("expires_at", f"grant {parent.id!r} expired at {utc(parent.expires_at).isoformat()}")
    if not parent.can_delegate:
        raise DelegationRefused("can_delegate", f"grant {parent.id!r} does not allow delegation")
    if any(c in principal for c in "*?["):
        raise DelegationRefused("principal", f"delegate to one principal, not the pattern {principal!r}")
    unknown = set(narrowed) - set(_SETS + _NUMBERS + _RIGHTS + ("expires_at",))
    if unknown:
        raise DelegationRefused(sorted(unknown)[0], f"not a grant dimension: {sorted(unknown)}")
    fields = {dim: getattr(parent, dim) for dim in _SETS + _NUMBERS + ("expires_at",)}
    fields.update(can_delegate=False, can_approve=False)
    fields.update(narrowed)
    child = Grant(id=id, principal=principal, parent=parent.id, **fields)
    wider = violations(parent, child)
    if wider:
        dimension, reason = wider[0]
        raise DelegationRefused(dimension, f"{reason} (grant {parent.id!r} -> {id!r})")
    return child


class ChainBroken(ValueError):
    """No valid chain of grants leads from a root to the grant a run acts under."""


def resolve_chain(leaf_id: str, roots: dict[str, Grant], delegated: dict[str, Grant], revoked: set[str],
                  now: datetime | None = None) -> list[Grant]:
    """The chain root -> ... -> leaf, checked link by link; raise ChainBroken naming the broken link.

    Each link must exist, be unrevoked (in the grant or in `revoked`, so a
    revocation cascades to everything below it) and unexpired, and be within
    its parent on every dimension: a stored grant that was widened after the
    fact breaks its chain too.
    """
    now = now or datetime.now(timezone.utc)
    chain: list[Grant] = []
    current: str | None = leaf_id
    while current is not None:
        grant = roots.get(current) or delegated.get(current)  # a stored grant never shadows a root
        if grant is None:
            raise ChainBroken(f"grant {current!r} does not exist")
        if grant.id in {g.id for g in chain}:
            raise ChainBroken(f"grant {current!r} is its own ancestor")
        if grant.revoked or grant.id in revoked:
            raise ChainBroken(f"grant {grant.id!r} is revoked")
        if grant.expires_at is not None and now >= utc(grant.expires_at):
            raise ChainBroken(f"grant {grant.id!r} expired at {utc(grant.expires_at).isoformat()}")
        if chain:
            wider = violations(grant, chain[-1])
            if wider:
                raise ChainBroken(f"grant {chain[-1].id!r} is wider than its parent {grant.id!r} in {wider[0][0]}")
            if not grant.can_delegate:
                raise ChainBroken(f"grant {grant.id!r} may not delegate, yet {chain[-1].id!r} names it as parent")
        if grant.parent is None and grant.id not in roots:
            raise ChainBroken(f"grant {grant.id!r} claims to be a root but is not in the AuthorityBlock")
        chain.append(grant)
        current = grant.parent
    return list(reversed(chain))
