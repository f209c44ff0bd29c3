"""Approval hooks: who decides when the policy says a person must approve.

Two implementations: `PolicyApprover` decides at once (no person; "ask"
resolves to its `on_ask` action, deny unless told otherwise) and
`PrefectPauseApprover` pauses the flow run with a typed form that the Prefect
UI renders, resumed through the Prefect API. Silence past the timeout denies.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

from prefect.input import RunInput
from pydantic import BaseModel, ConfigDict, Field


class ApprovalRequest(BaseModel):
    """Everything an approver needs to decide one run."""

    model_config = ConfigDict(frozen=True)

    flow_run_id: str
    task_run_id: str
    task_name: str
    principal: str
    grant_id: str
    request: dict[str, Any]
    est_cost: float
    currency: str
    remaining_budget: float | None  # least money left on any covering budget after the hold; None: no money limit
    rule: str | None
    timeout_seconds: int

    def describe(self) -> str:
        req = ", ".join(f"{k}={v}" for k, v in self.request.items() if v not in (None, 0, 0.0))
        return (
            f"**Approve AI task `{self.task_name}`?**\n\n"
            f"- principal: `{self.principal}` (grant `{self.grant_id}`)\n"
            f"- request: {req}\n"
            f"- estimated cost: {self.est_cost:.4f} {self.currency} "
            + (f"(budget left after hold: {self.remaining_budget:.4f})" if self.remaining_budget is not None else "(no money limit)")
            + "\n"
            f"- asked by rule: `{self.rule}`\n"
            f"- no answer within {self.timeout_seconds}s denies the run"
        )


class ApprovalDecision(BaseModel):
    """A decision and who made it."""

    model_config = ConfigDict(frozen=True)

    approved: bool
    approver: str
    reason: str = ""
    channel: str


@runtime_checkable
class Approver(Protocol):
    def decide(self, request: ApprovalRequest) -> ApprovalDecision: ...


class ApprovalInput(RunInput):
    """The form a person fills in the Prefect UI to approve or reject a paused run."""

    approve: bool = Field(description="Tick to approve the run, leave unticked to reject it.")
    approver: str = Field(description="Who is deciding (must not be the requesting principal).")
    reason: str = Field(default="", description="Why.")


class PolicyApprover(BaseModel):
    """Decide without a person: runs the policy sends to a person get `on_ask`."""

    on_ask: Literal["approve", "deny"] = "deny"

    def decide(self, request: ApprovalRequest) -> ApprovalDecision:
        approved = self.on_ask == "approve"
        return ApprovalDecision(
            approved=approved, approver="policy", channel="policy",
            reason=f"rule {request.rule!r} asks for a person; no person channel configured, so {self.on_ask}",
        )


class PrefectPauseApprover(BaseModel):
    """Pause the flow run for a typed approval form; resume comes from the UI or the API."""

    poll_interval: int = Field(default=2, ge=1)

    def decide(self, request: ApprovalRequest) -> ApprovalDecision:
        from prefect.exceptions import FlowPauseTimeout
        from prefect.flow_runs import pause_flow_run

        try:
            answer = pause_flow_run(
                wait_for_input=ApprovalInput.with_initial_data(
                    description=request.describe(), approve=False, approver="", reason=""
                ),
                timeout=request.timeout_seconds,
                poll_interval=self.poll_interval,
                key=f"aisched-approval-{request.task_run_id}",
            )
        except FlowPauseTimeout:
            return ApprovalDecision(
                approved=False, approver="timeout", channel="prefect-pause",
                reason=f"no decision within {request.timeout_seconds}s: silence denies",
            )
        if answer.approver.strip() == "" or answer.approver == request.principal:
            return ApprovalDecision(
                approved=False, approver=answer.approver or "(anonymous)", channel="prefect-pause",
                reason="the requester cannot approve its own run, and an approver must give a name",
            )
        return ApprovalDecision(approved=answer.approve, approver=answer.approver,
                                reason=answer.reason, channel="prefect-pause")
