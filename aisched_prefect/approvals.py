"""Approval hooks: who decides when the policy says a person must approve, and how they prove it.

Two implementations: `PolicyApprover` decides at once (no person; "ask"
resolves to its `on_ask` action, deny unless told otherwise) and
`PrefectPauseApprover` pauses the flow run (a deployment run: suspends it)
with a typed form that the Prefect UI renders, resumed through the Prefect
API. Silence past the timeout denies.

Prefect's open-source server has no user identity: anyone with API access can
resume a run and type any name. What an approver *can* prove is possession of
a private key: `aisched approve` signs the answer (Ed25519) over the approval's
digest, which hashes exactly what was shown (flow run and task, parameters,
request, cost estimate, rule). A signature therefore cannot be forged by the
requester and cannot be replayed onto another or a changed request.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal, Protocol, runtime_checkable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from prefect.input import RunInput
from pydantic import BaseModel, ConfigDict, Field


def approval_digest(*, run_key: str, task_name: str, parameters: str | None, request: dict[str, Any],
                    est_cost: float, currency: str, rule: str | None) -> str:
    """The hash an approval is bound to: what the approver was shown, exactly.

    `run_key` names the task within its flow run (flow run, task key), not the
    task run id: a suspended flow run re-runs from the start with new task run
    ids, and the answer must still bind to the same call. Identical calls of
    one flow run are told apart by `ApprovalRequest.call_index`.
    """
    body = {"run": run_key, "task": task_name, "parameters": parameters, "request": request,
            "est_cost": round(est_cost, 6), "currency": currency, "rule": rule}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def _signed_body(digest: str, approve: bool, approver: str, reason: str, signed_at: float) -> bytes:
    body = {"digest": digest, "approve": approve, "approver": approver, "reason": reason, "signed_at": repr(float(signed_at))}
    return b"aisched-approval/1\n" + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def public_key_hex(key: Ed25519PrivateKey) -> str:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def sign_approval(key: Ed25519PrivateKey, digest: str, approve: bool, approver: str, reason: str,
                  signed_at: float) -> str:
    """The signature `aisched approve` attaches to an answer."""
    return key.sign(_signed_body(digest, approve, approver, reason, signed_at)).hex()


def signature_valid(public_hex: str, digest: str, decision: ApprovalDecision) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_hex)).verify(
            bytes.fromhex(decision.signature),
            _signed_body(digest, decision.approved, decision.approver, decision.reason, decision.signed_at))
        return True
    except (InvalidSignature, ValueError):
        return False


class ApprovalRequest(BaseModel):
    """Everything an approver needs to decide one run."""

    model_config = ConfigDict(frozen=True)

    flow_run_id: str
    task_run_id: str
    task_name: str
    principal: str
    grant_id: str
    chain: list[str] = []
    request: dict[str, Any]
    est_cost: float
    currency: str
    remaining_budget: float | None  # least money left on any covering budget after the hold; None: no money limit
    rule: str | None
    timeout_seconds: int
    digest: str = ""
    approvals_required: int = 1
    approved_by: list[str] = []  # approvers counted so far (k of n)
    round: int = 0  # how many answers came before this one (each answer is its own pause)
    items: list[dict[str, Any]] = []  # a batch: every run it covers (task_run_id, task, request, est_cost)
    require_signature: bool = False
    call_index: int = 0  # identical calls (same digest) of this flow run already run to completion before this one

    def describe(self) -> str:
        req = ", ".join(f"{k}={v}" for k, v in self.request.items() if v not in (None, 0, 0.0))
        batch = "".join(f"  - `{i['task']}` {i['task_run_id'][:8]}: {i['est_cost']:.4f} {self.currency}\n"
                        for i in self.items)
        quorum = (f"- approvals needed: {self.approvals_required} different approvers; so far: "
                  f"{', '.join(self.approved_by) or 'none'}\n") if self.approvals_required > 1 else ""
        return (
            f"**Approve AI task `{self.task_name}`?**\n\n"
            f"- principal: `{self.principal}`, grant chain `{' -> '.join(self.chain or [self.grant_id])}`\n"
            f"- request: {req}\n"
            f"- estimated cost: {self.est_cost:.4f} {self.currency} "
            + (f"(budget left after hold: {self.remaining_budget:.4f})" if self.remaining_budget is not None else "(no money limit)")
            + "\n"
            f"- asked by rule: `{self.rule}`\n"
            + (f"- one answer for all {len(self.items)} runs of this batch:\n{batch}" if self.items else "")
            + quorum +
            f"- no answer within {self.timeout_seconds}s denies the run\n"
            f"- approval digest `{self.digest[:16]}...`; to sign your answer: `aisched approve {self.task_run_id[:8]} --as NAME --key KEY`"
            + ("; this rule counts only signed approvals" if self.require_signature else "")
        )


class ApprovalDecision(BaseModel):
    """A decision, who made it, and their signature if they signed it."""

    model_config = ConfigDict(frozen=True)

    approved: bool
    approver: str
    reason: str = ""
    channel: str
    signature: str = ""
    signed_at: float = 0.0


@runtime_checkable
class Approver(Protocol):
    def decide(self, request: ApprovalRequest) -> ApprovalDecision: ...


class ApprovalInput(RunInput):
    """The form a person fills in the Prefect UI to approve or reject a paused run."""

    approve: bool = Field(description="Tick to approve the run, leave unticked to reject it.")
    approver: str = Field(description="Who is deciding (must not be the requesting principal).")
    reason: str = Field(default="", description="Why.")
    signature: str = Field(default="", description="Leave empty in the UI; `aisched approve` fills it to prove who decided.")
    signed_at: float = Field(default=0.0, description="Set by `aisched approve` with the signature.")


class PolicyApprover(BaseModel):
    """Decide without a person: runs the policy sends to a person get `on_ask`."""

    on_ask: Literal["approve", "deny"] = "deny"

    def decide(self, request: ApprovalRequest) -> ApprovalDecision:
        approved = self.on_ask == "approve"
        return ApprovalDecision(
            approved=approved, approver="policy", channel="policy",
            reason=f"rule {request.rule!r} asks for a person; no person channel configured, so {self.on_ask}",
        )


def pause_key(request: ApprovalRequest) -> str:
    """One pause (or suspension) per answer, the same on the re-run of a resumed suspended flow run.

    Prefect returns the stored answer when a key was used before, so the key
    names the call (digest, and how many identical calls completed before it:
    those are read from their persisted results on a re-run, never asked
    again) and the answer (round).
    """
    return f"aisched-approval-{request.digest[:32]}-{request.call_index}-{request.round}"


class PrefectPauseApprover(BaseModel):
    """Wait for a typed approval form that the Prefect UI renders; answers come from the UI, the API or `aisched approve`.

    A run started by a deployment is *suspended* (`suspend_flow_run`): its
    process exits, so an overnight wait holds no process and, by the session's
    rule, no budget; when a person answers, Prefect reschedules it, it re-runs
    from the start (completed tasks come from their persisted results) and the
    same call finds its answer under the same pause key. Any other run (a
    script, a test) is *paused* in-process, polling every `poll_interval`.
    """

    poll_interval: int = Field(default=2, ge=1)
    suspend_deployment_runs: bool = True

    def decide(self, request: ApprovalRequest) -> ApprovalDecision:
        from prefect.context import FlowRunContext
        from prefect.exceptions import FlowPauseTimeout
        from prefect.flow_runs import pause_flow_run, suspend_flow_run

        form = ApprovalInput.with_initial_data(description=request.describe(), approve=False, approver="", reason="")
        key = pause_key(request)
        ctx = FlowRunContext.get()
        if self.suspend_deployment_runs and ctx is not None and ctx.flow_run is not None and ctx.flow_run.deployment_id:
            # Suspending *this* flow run by id works from a task's thread: Prefect stops the flow at its next
            # orchestration boundary. On the re-run after resume the same key returns the answer at once.
            answer = suspend_flow_run(wait_for_input=form, flow_run_id=ctx.flow_run.id,
                                      timeout=request.timeout_seconds, key=key)
            if answer is None:
                from aisched_prefect.errors import ApprovalSuspended

                raise ApprovalSuspended(
                    f"flow run {request.flow_run_id} is suspended until a person answers the approval of "
                    f"{request.task_name!r} (within {request.timeout_seconds}s): resume it from the Prefect UI or "
                    f"`aisched approve {request.task_run_id[:8]} --as NAME`; it then re-runs on its work pool")
        else:
            try:
                answer = pause_flow_run(wait_for_input=form, timeout=request.timeout_seconds,
                                        poll_interval=self.poll_interval, key=key)
            except FlowPauseTimeout:
                return ApprovalDecision(
                    approved=False, approver="timeout", channel="prefect-pause",
                    reason=f"no decision within {request.timeout_seconds}s: silence denies",
                )
        return ApprovalDecision(approved=answer.approve, approver=answer.approver.strip(), reason=answer.reason,
                                channel="signed" if answer.signature else "prefect-pause",
                                signature=answer.signature, signed_at=answer.signed_at)
