"""The command-line approval channel: list runs waiting for a person, answer one (signed).

The answer goes where the UI's goes: `resume_flow_run` on the paused flow run,
with the same typed input, plus a signature that only the approver's private
key can make, over the digest of exactly the request that is waiting.
"""

from __future__ import annotations

import time
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from pydantic import BaseModel

from aisched_prefect.approvals import sign_approval
from aisched_prefect.errors import AISchedError
from aisched_prefect.ledger import Ledger

_ENDS_A_REQUEST = {"approval", "admission", "settlement", "denial"}


class NoSuchApproval(AISchedError):
    """The id names no run that is waiting for approval."""


class PendingApproval(BaseModel):
    """One run waiting for a person, as the ledger recorded it."""

    task_run_id: str
    flow_run_id: str | None
    task: str | None
    principal: str | None
    rule: str | None
    est_cost: float
    digest: str
    approvals_required: int
    votes: list[str]
    asked_at: float
    items: list[str] = []  # a batch: every task run one answer covers (this id is the first)


def pending(ledger: Ledger) -> list[PendingApproval]:
    """Runs with an approval request and no decision yet, oldest first."""
    open_: dict[str, PendingApproval] = {}
    for r in ledger.records():
        if r.task_run_id is None:
            continue
        if r.kind == "approval-requested":
            p = r.payload
            open_[r.task_run_id] = PendingApproval(
                task_run_id=r.task_run_id, flow_run_id=r.flow_run_id, task=p.get("task"), principal=r.principal,
                rule=p.get("approval_rule"), est_cost=(p.get("estimate") or {}).get("amount", 0.0),
                digest=p.get("approval_digest", ""), approvals_required=p.get("approvals_required", 1),
                votes=[], asked_at=r.ts)
        elif r.kind == "approval-batch":
            members = [open_.pop(i) for i in r.payload["items"] if i in open_]
            if members:
                open_[members[0].task_run_id] = members[0].model_copy(update={
                    "digest": r.payload["digest"], "est_cost": r.payload["est_cost"], "task": r.payload["task"],
                    "items": [m.task_run_id for m in members]})
        elif r.kind == "approval-vote" and r.task_run_id in open_ and r.payload.get("counted"):
            open_[r.task_run_id].votes.append(r.payload.get("approver", "?"))
        elif r.kind in _ENDS_A_REQUEST:
            for key, a in list(open_.items()):
                if key == r.task_run_id or r.task_run_id in a.items:
                    del open_[key]
    return sorted(open_.values(), key=lambda a: a.asked_at)


def load_key(path: str) -> Ed25519PrivateKey:
    with open(path, "rb") as f:
        key = load_pem_private_key(f.read(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise AISchedError(f"{path} is not an Ed25519 private key: make one with `aisched approvals keygen --out {path}`")
    return key


def answer(ledger: Ledger, task_run_id: str, *, approve: bool, approver: str, reason: str,
           key: Ed25519PrivateKey | None) -> dict[str, Any]:
    """Resume the paused run with this answer, signed when a key is given; returns the input sent."""
    from prefect.flow_runs import resume_flow_run

    matches = [a for a in pending(ledger) if any(i.startswith(task_run_id) for i in [a.task_run_id, *a.items])]
    if len(matches) != 1:
        raise NoSuchApproval(
            f"{'no' if not matches else 'more than one'} run waiting for approval matches {task_run_id!r}: "
            "see `aisched approvals list` for the ids")
    ask = matches[0]
    signed_at = time.time()
    run_input: dict[str, Any] = {"approve": approve, "approver": approver, "reason": reason,
                                 "signature": "", "signed_at": 0.0}
    if key is not None:
        run_input.update(signed_at=signed_at,
                         signature=sign_approval(key, ask.digest, approve, approver, reason, signed_at))
    resume_flow_run(ask.flow_run_id, run_input=run_input)
    return run_input
