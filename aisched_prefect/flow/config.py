"""The runner's configuration: plain data, so the runner pickles and duplicates cleanly.

What a flow may say here is what it asks for, never what it is allowed: who it
is and what configuration it runs under come from its credential at the
control plane. Anything that would let a flow choose its own trust root (an
inline block, a ledger, a Dask scheduler) is refused with the setting to use.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

REFUSED = {
    "ledger_url": "the ledger belongs to the control plane: set AISCHED_LEDGER_URL where `aisched serve` runs",
    "address": "the Dask scheduler belongs to the control plane: `aisched serve --dask-address tcp://...`",
    "hold_lease_seconds": "budget leases are the control plane's: AISCHED_HOLD_LEASE_SECONDS where it runs",
    "top_up_fraction": "top-ups are the control plane's: AISCHED_TOP_UP_FRACTION where it runs",
    "ticket_ttl_seconds": "tickets are the control plane's: AISCHED_TICKET_TTL_SECONDS where it runs",
}


class RunnerConfig(BaseModel):
    """Everything AISchedTaskRunner was constructed with."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True, extra="forbid")

    principal: str | None = Field(default=None, min_length=1)
    tenant: str | None = Field(default=None, min_length=1)
    grant: str | None = None
    authority: str | None = None
    budget: str | None = None
    approval_policy: str | None = None
    cluster: str | None = None
    approver: str = "pause"
    declared: str | None = None
    max_workers: int | None = None
    approval_hook: Any = None  # a callable(ApprovalView), or a URL that gets each request as JSON
    queue: bool = True
    control_plane: str | None = None
    credential: str | None = None

    @field_validator("authority", "budget", "approval_policy", "cluster", mode="before")
    @classmethod
    def _names_only(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        raise ValueError(f"pass the block's name, not a {type(v).__name__} object: an inline block would let a "
                         "flow write its own authority. Save the block, and (with `aisched serve`) have an operator "
                         "apply it: aisched apply")

    @field_validator("approval_hook")
    @classmethod
    def _hook_kind(cls, v: Any) -> Any:
        if v is None or callable(v) or (isinstance(v, str) and v.startswith(("http://", "https://"))):
            return v
        raise ValueError("approval_hook must be a callable taking an ApprovalView, or an http(s) URL")

    @field_validator("principal")
    @classmethod
    def _principal_shape(cls, v: str | None) -> str | None:
        if v is not None and (v != v.strip() or set("*?[") & set(v)):
            raise ValueError("principal must be a plain name like 'team-a/nightly' (no spaces around it, no '*')")
        return v

    @field_validator("approver")
    @classmethod
    def _approver_kind(cls, v: Any) -> Any:
        if v in ("pause", "policy"):
            return v
        raise ValueError("approver must be 'pause' (a person answers at the control plane) or 'policy' (nobody is "
                         "asked: a rule that asks a person denies); an approver object in the flow process would let "
                         "the flow approve itself")
