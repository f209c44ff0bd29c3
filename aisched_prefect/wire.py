"""What crosses between a flow process and the control plane: typed messages and one binary frame.

A call carries JSON metadata and the pickled body (function and arguments)
side by side; the reply carries JSON metadata and the pickled result. The
control plane reads the metadata and never unpickles either blob.

>>> meta, blob = unframe(frame(b'{"a": 1}', b"xyz"))
>>> (meta, blob)
(b'{"a": 1}', b'xyz')
"""

from __future__ import annotations

import struct
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

FRAME = "application/x-aisched-frame"
_LEN = struct.Struct(">I")


def frame(meta: bytes, blob: bytes = b"") -> bytes:
    return _LEN.pack(len(meta)) + meta + blob


def unframe(data: bytes) -> tuple[bytes, bytes]:
    if len(data) < _LEN.size:
        raise ValueError("empty frame")
    (n,) = _LEN.unpack_from(data)
    if n > len(data) - _LEN.size:
        raise ValueError("frame shorter than its header says")
    return data[_LEN.size:_LEN.size + n], data[_LEN.size + n:]


class MapShard(BaseModel):
    """Which shard of which `.map()` a call is: the flow says so, the control plane shares one decision (and one
    approval) only among calls that are the same request in all but their arguments."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^[0-9a-f]{32}$")  # one per `.map()` call, random
    index: int = Field(ge=0)
    size: int | None = Field(default=None, ge=1)  # its shards, where the flow knew them before submitting
    name: str = Field(default="", max_length=200)  # the shard's task run name, e.g. "infer-7": how refusals name it


class CallMeta(BaseModel):
    """One call of an AI task, as the flow process describes it. Nothing here is trusted for authority:
    who calls comes from the credential, what it may do from the control plane's applied configuration."""

    model_config = ConfigDict(extra="forbid")

    task_name: str = Field(min_length=1, max_length=200)
    task_run_id: str = Field(min_length=1, max_length=64)
    flow_run_id: str = Field(min_length=1, max_length=64)
    flow_name: str | None = Field(default=None, max_length=200)
    run_key: str = Field(min_length=1, max_length=300)
    request: dict[str, Any]
    code_digest: str = Field(min_length=64, max_length=64)
    modules: list[Annotated[str, Field(max_length=300)]] = Field(default_factory=list, max_length=64)  # MAX_PRELOADS
    args_offset: int = Field(default=0, ge=0)  # where the function's pickle ends and the arguments' begin
    grant: str | None = Field(default=None, max_length=200)
    approver: Literal["pause", "policy"] = "pause"
    admission: str | None = None  # continue this admission once its approval is decided
    attempt: int = Field(default=1, ge=1)
    parameters: dict[str, Annotated[str, Field(max_length=200)]] = Field(default_factory=dict, max_length=32)
    """A short text of each argument, for the approver to read (what the flow says; the approval binds the arguments'
    bytes by digest)."""
    array: MapShard | None = None
    """The `.map()` this call is a shard of (a job array: one decision, one approval for all its shards), or None."""


class ApprovalView(BaseModel):
    """A pending or decided approval, as the control plane's records say (never as a flow says)."""

    id: str
    status: Literal["pending", "approved", "rejected", "expired", "suspended", "consumed", "withdrawn"]
    digest: str
    task_name: str
    task_run_id: str
    flow_run_id: str
    principal: str
    rule: str | None = None
    est_cost: float = 0.0  # the run's estimate and the idle time it may leave warm (control.idle_price)
    idle_cost: float = 0.0  # of which: its body's idle time after the run
    idle_seconds: float = 0.0  # how long that idle time may be
    currency: str = "USD"
    request: dict[str, Any] = {}
    chain: list[str] = []
    deadline: float
    timeout_seconds: int
    approvals_required: int = 1
    approvers: list[str] = []  # who may approve it (approvers whose grants cover it, the requester excluded), as filed
    require_signature: bool = False
    parameters: dict[str, str] = {}
    approved_by: list[str] = []
    decided_by: str | None = None
    reason: str = ""
    url: str = ""
    describe: str = ""


class DirectResult(BaseModel):
    """A result its worker kept (dask_gpu.worker.results): the flow fetches it there, once, with the token, and checks its
    bytes against `digest` (the one the control plane recorded in the settlement) before it unpickles them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(max_length=300, pattern=r"^https?://[^/?#\s]+$")  # the worker's listener: {url}/results/{token}
    token: str = Field(min_length=32, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)
    expires_at: float


class ResultLostIn(BaseModel):
    """A flow's report that a completed call's large result could not be fetched from its worker."""

    model_config = ConfigDict(extra="forbid")

    key: str = Field(min_length=1, max_length=300)  # the call's key (Reply.key)
    reason: str = Field(default="", max_length=1000)  # what the last fetch attempt met


class Reply(BaseModel):
    """How a call ended, or why it is waiting."""

    status: Literal["completed", "failed", "stopped", "denied", "approval-pending", "accepted"]
    admission: str | None = None
    key: str = ""  # the call's key at the control plane: its outcome arrives under it
    result_digest: str = ""  # sha256 of the result's bytes: checked before they are unpickled
    result_ref: DirectResult | None = None  # a completed call's large result: on its worker, not in this reply
    stage: str | None = None
    reason: str = ""
    fix: str = ""
    approval: ApprovalView | None = None
    error_type: str = ""
    error_message: str = ""
    error_text: str = ""
    logs: list[tuple[int, str]] = []
    placement: dict[str, Any] = {}
    charged: dict[str, float] = {}

    @model_validator(mode="after")
    def _one_digest(self) -> Reply:
        if self.result_ref is not None and self.result_digest != self.result_ref.digest:
            raise ValueError("result_digest must be the digest of result_ref (the one the settlement recorded)")
        return self


class RunIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    meta: CallMeta
    function: int = Field(ge=0)
    args_length: int = Field(ge=0)


class RunsIn(BaseModel):
    """Many calls in one request (a `.map()` arrives as one): the body's function pickles are sent once each.

    The frame's blob is every function pickle (`functions`: their lengths, in order), then every call's argument
    pickle (`calls[i].args_length`); call i's body is function `calls[i].function` followed by its arguments.
    """

    model_config = ConfigDict(extra="forbid")

    session: str = Field(min_length=16, max_length=64)
    functions: list[int] = Field(max_length=64)
    calls: list[RunIn] = Field(min_length=1, max_length=10_000)


class OutcomeOut(BaseModel):
    """One ended call on the outcome stream; its result's bytes follow in the frame (`length` of them)."""

    key: str
    seq: int
    reply: Reply
    length: int


class OutcomesOut(BaseModel):
    outcomes: list[OutcomeOut]
    pending: int  # the session's calls not ended yet
    replica: str = ""  # who answered: a flow whose calls another replica accepted sends them here again
    instance: str = ""  # which life of the plane answered: a new one knows none of the calls an earlier one accepted


class Problem(BaseModel):
    """An error the control plane answers with: what was wrong and how to fix it."""

    error: str
    field: str | None = None
    fix: str = ""
