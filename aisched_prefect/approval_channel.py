"""The command-line approval channel: list runs waiting for a person, answer one (signed).

The answer goes where the UI's goes: `resume_flow_run` on the paused flow run,
with the same typed input, plus a signature that only the approver's private
key can make, over the digest of exactly the request that is waiting.
"""

from __future__ import annotations

import math
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


def pending(ledger: Ledger, now: float | None = None) -> list[PendingApproval]:
    """Runs with an approval request and no decision yet, oldest first.

    Requests are known by their digest: a suspended deployment run re-runs
    after resume with new task run ids but the same digest, so its request
    stays one entry. A suspended request past its deadline is no longer
    listed (Prefect refuses to resume it; its holds were released when it
    was suspended).
    """
    now = time.time() if now is None else now
    open_: dict[str, PendingApproval] = {}  # digest -> request
    expires: dict[str, float] = {}

    def find(r: Any) -> str | None:
        digests = {r.payload.get("approval_digest"), r.payload.get("batch_digest"), r.payload.get("digest")}
        for digest, a in open_.items():
            if digest in digests or r.task_run_id == a.task_run_id or r.task_run_id in a.items:
                return digest
        return None

    for r in ledger.records():
        if r.task_run_id is None:
            continue
        p = r.payload
        if r.kind == "approval-requested":
            digest = p.get("approval_digest", "")
            if digest not in open_:
                open_[digest] = PendingApproval(
                    task_run_id=r.task_run_id, flow_run_id=r.flow_run_id, task=p.get("task"), principal=r.principal,
                    rule=p.get("approval_rule"), est_cost=(p.get("estimate") or {}).get("amount", 0.0),
                    digest=digest, approvals_required=p.get("approvals_required", 1), votes=[], asked_at=r.ts)
        elif r.kind == "approval-batch":
            members = [m for d, m in list(open_.items()) if m.task_run_id in p["items"] and not m.items]
            for m in members:
                del open_[m.digest]
            if members and p["digest"] not in open_:
                open_[p["digest"]] = members[0].model_copy(update={
                    "digest": p["digest"], "est_cost": p["est_cost"], "task": p["task"],
                    "items": [m.task_run_id for m in members]})
        elif r.kind == "approval-suspended":
            if (digest := find(r)) is not None:
                expires[digest] = p.get("expires_at", math.inf)
        elif r.kind == "approval-vote" and p.get("counted"):
            if (digest := find(r)) is not None:
                open_[digest].votes.append(p.get("approver", "?"))
        elif r.kind in _ENDS_A_REQUEST:
            if (digest := find(r)) is not None:
                del open_[digest]
                expires.pop(digest, None)
    live = [a for d, a in open_.items() if expires.get(d, math.inf) > now]
    return sorted(live, key=lambda a: a.asked_at)


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
