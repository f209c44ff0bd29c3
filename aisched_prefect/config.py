"""The runner's configuration: plain data, so the runner pickles and duplicates cleanly."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from blocks import ApprovalPolicyBlock, AuthorityBlock, BudgetBlock, ClusterBlock


class RunnerConfig(BaseModel):
    """Everything AISchedTaskRunner was constructed with."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    principal: str = Field(min_length=1)
    tenant: str | None = Field(default=None, min_length=1)
    grant: str | None = None
    authority: str | AuthorityBlock
    budget: str | BudgetBlock
    approval_policy: str | ApprovalPolicyBlock | None = None
    approver: Any = "pause"
    address: str | None = None
    declared: str | None = None
    ledger_url: str | None = None
    max_workers: int | None = None
    ticket_ttl_seconds: float = Field(default=24 * 3600, gt=0)
    hold_lease_seconds: float = Field(default=300.0, ge=1)
    top_up_fraction: float = Field(default=0.5, gt=0, le=10)
    approval_hook: Any = None  # a callable(ApprovalRequest), or a URL that gets each request as JSON
    cluster: str | ClusterBlock | None = None
    queue: bool = False

    @field_validator("approval_hook")
    @classmethod
    def _hook_kind(cls, v: Any) -> Any:
        if v is None or callable(v) or (isinstance(v, str) and v.startswith(("http://", "https://"))):
            return v
        raise ValueError("approval_hook must be a callable taking an ApprovalRequest, or an http(s) URL")

    @field_validator("principal")
    @classmethod
    def _principal_shape(cls, v: str) -> str:
        if v != v.strip() or "*" in v:
            raise ValueError("principal must be a plain name like 'team-a/nightly' (no spaces around it, no '*')")
        return v

    @field_validator("approver")
    @classmethod
    def _approver_kind(cls, v: Any) -> Any:
        if v in ("pause", "policy") or hasattr(v, "decide"):
            return v
        raise ValueError("approver must be 'pause', 'policy' or an object with decide(ApprovalRequest)")
