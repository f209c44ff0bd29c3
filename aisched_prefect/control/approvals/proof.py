"""Who answered an approval, proved, and whether they may approve the run: the checks an answer must pass.

An answer proves its approver by an approver's credential, a one-time link made for them, or a signature by a key in
the applied authority's `approver_keys`; the approver must hold a grant with `can_approve` whose chain still stands
and which covers the run. Nothing here writes: the approval book (approvals.py) counts what passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aisched_prefect.approvals import ApprovalDecision, signature_valid
from aisched_prefect.control.admission import stages
from aisched_prefect.control.admission.record import Admission
from aisched_prefect.control.authority.identity import Credential
from aisched_prefect.control.authority.state import AuthorityState
from aisched_prefect.errors import AISchedError
from aisched_prefect.wire import ApprovalView
from blocks import ChainBroken, Grant


class ApprovalError(AISchedError):
    """An answer that cannot be taken: unknown approval, already decided, or not from an approver."""

    def __init__(self, message: str, status: int = 400) -> None:
        self.status = status
        super().__init__(message)


@dataclass(frozen=True)
class LinkHolder:
    """Whoever opened a one-time approval link: it proves the approver it was made for, for one request, once."""

    principal: str
    link_id: str
    approval_id: str
    used: bool


def approver_chain(snap: Any, authority: Any, who: str, adm: Admission) -> list[Grant] | None:
    """The chain of a grant `who` holds with can_approve that covers this run, or None."""
    for grant in snap.grants_of(authority, who):
        if not grant.can_approve:
            continue
        try:
            chain = stages.chain_of(snap, authority, grant.id)
        except ChainBroken:
            continue
        if grant.refusal(adm.facts.model_copy(update={"principal": who})) is None:
            return chain
    return None


def authority_of(state: AuthorityState, adm: Admission) -> tuple[Any, Any]:
    """The current snapshot and the applied authority the run was admitted under (its current version)."""
    snap = state.refresh()
    name = adm.versions.get("authority", "").split(":", 1)[-1].rsplit("@", 1)[0]
    authority = snap.config("authority", name)
    if authority is None:
        raise ApprovalError("the authority this run was admitted under is no longer applied", 409)
    return snap, authority


def identify(view: ApprovalView, adm: Admission, authority: Any, decision: ApprovalDecision,
              caller: Credential | LinkHolder | None, signed: str) -> tuple[str, str]:
    """Who answered, proved: by an approver's credential, or by a signature over `signed` (this request's
    digest, or the batch digest of the requests answered together)."""
    if isinstance(caller, LinkHolder):
        if view.require_signature:
            raise ApprovalError(f"rule {view.rule!r} counts only signed approvals: "
                                f"aisched approve {view.id} --key KEY", 403)
        if caller.approval_id != view.id:
            raise ApprovalError("this link was made for another request", 403)
        who, channel = caller.principal, "link"
    elif decision.signature:
        who = decision.approver.strip()
        key = authority.model.approver_keys.get(who)
        if key is None:
            raise ApprovalError(f"{who!r} signed, but has no key in the applied authority's approver_keys", 403)
        if not signature_valid(key, signed, decision):
            raise ApprovalError(f"the signature of {who!r} does not match this request (digest {signed[:12]}...): "
                                "it was made for another request, or this one changed", 403)
        channel = "signed"
    else:
        if caller is None or caller.role not in ("approver", "operator"):
            raise ApprovalError("an answer needs an approver's credential or signature: a flow's credential "
                                "cannot approve", 403)
        if caller.role == "approver" and caller.authority is not None and caller.authority != authority.name:
            raise ApprovalError(f"the credential of {caller.principal!r} was issued for authority "
                                f"{caller.authority!r}; this run is under {authority.name!r}", 403)
        if view.require_signature:
            raise ApprovalError(f"rule {view.rule!r} counts only signed approvals: "
                                f"aisched approve {view.id} --key KEY", 403)
        who, channel = caller.principal, "credential"
    if who == adm.principal:
        raise ApprovalError("the requester cannot approve its own run", 403)
    return who, channel


def approvers_of(state: AuthorityState, adm: Admission) -> list[str]:
    """Everyone who may approve this run now (a grant with can_approve covering it), the requester excluded:
    who the approval hook sends a link to."""
    snap, authority = authority_of(state, adm)
    idx = snap.index(authority)
    names = {*idx.by_principal, *(p for (a, p) in snap.delegated_to if a in (authority.name, None))}
    groups = getattr(authority.model, "groups", {}) or {}
    names |= {m for members in groups.values() for m in members}
    return sorted(n for n in names if isinstance(n, str) and n != adm.principal and not n.startswith("group:")
                  and approver_chain(snap, authority, n, adm) is not None)


def decided_in_the_log(records: list[Any], approval_id: str, trusted: list[bytes]) -> bool:
    """The decision that allows an execution is a record of it in the chain this control plane signed, not a row's
    status (a row set in the database executes nothing)."""
    from aisched_prefect.evidence import record_signed

    return any(r.kind == "approval" and r.payload.get("approval") == approval_id and r.payload.get("approved")
               and (not trusted or record_signed(r, trusted)) for r in records)
