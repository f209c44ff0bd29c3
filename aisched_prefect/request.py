"""The immutable request an @ai_task declares: what it needs, what it is, what it will cost."""

from __future__ import annotations

import hashlib
import json
import re
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from aisched_prefect.errors import InvalidAIRequest
from dask_gpu import GPURequest
from dask_gpu.request import MAX_GPU_MEMORY_GB

_KIND = re.compile(r"^[a-z][a-z0-9-]*$")
MAX_EST_SECONDS = 366 * 86_400.0
"""A year: longer is a typo or inf, and would price a hold no budget can hold."""
MAX_EST_TOKENS = 10**12
WARM_KINDS = frozenset({"inference", "batch-inference", "embedding"})  # kinds whose bodies stay warm by default
DEFAULT_KEEP_WARM_SECONDS = 300.0
NO_LIMIT_WORDS = frozenset({"none", "unlimited", "infinite", "inf"})  # time_limit= words for no limit (Slurm: UNLIMITED)


class AIRequest(BaseModel):
    """What one run of an AI task asks for. Validated once, at decoration time."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str = Field(description="What the task does: training, inference, model-call, ...")
    gpus: float = Field(default=0, ge=0, le=64, allow_inf_nan=False,
                        description="Whole GPUs on one worker, or a fraction (0.01 to 0.99) of one.")
    gpu_memory_gb: float | None = Field(
        default=None, gt=0, le=MAX_GPU_MEMORY_GB, allow_inf_nan=False,
        description="Whole GPUs: memory each must have. A fraction: memory reserved on the shared GPU.")
    gpu_type: str | tuple[str, ...] | None = Field(
        default=None, description="Required GPU type (H100, ...), or several acceptable ones; None = any.")
    model: str | None = Field(default=None, description="Model the task trains or calls.")
    est_seconds: float = Field(default=0, ge=0, le=MAX_EST_SECONDS, allow_inf_nan=False,
                               description="Expected runtime; prices the budget hold.")
    est_tokens: int = Field(default=0, ge=0, le=MAX_EST_TOKENS, description="Expected tokens; prices model calls.")
    priority: int = Field(default=0, ge=-100, le=100, description="Higher goes first.")
    preemptible: bool = Field(
        default=False, description="May borrow idle GPUs beyond its tenant's quota in the cluster's queue, and be "
        "stopped to give them back: charged for what ran, then queued again (it starts over unless it resumes "
        "from its own checkpoint). Needs whole GPUs and the cluster's queue (on by default).")
    hosts: int | None = Field(
        default=None, ge=1, le=64, description="Spread whole GPUs over this many whole workers, one process per host "
        "(a multi-host job: gpus=16, hosts=2 is 8 on each). None: one worker; a request wider than every worker "
        "is refused, naming the hosts= that would hold it (a body written for one process never runs twice).")

    time_limit: Literal["est_seconds"] | None = Field(
        default="est_seconds", description="A GPU run's est_seconds is its time limit, as Slurm's --time is: past it "
        "and the operator's grace it is asked to stop (checkpoint() raises StopRequested), then ended, recorded "
        "time-limit and charged for what ran. None (or 'unlimited'): no limit; planned on the tenant's worst observed "
        "overrun and its overrun charged at a premium in the queue's fairness.")
    requeue_on_time_limit: bool = Field(
        default=False, description="Stopped at its time limit, the run is charged for what ran and queued again (Slurm's "
        "--requeue): its function runs again with the same arguments and resumes from its own checkpoint files.")

    keep_warm: float | None = Field(
        default=None, ge=0, le=86_400, allow_inf_nan=False,
        description="Seconds a run's body may wait warm for the next run of the same task, principal and request "
        "(its module state and loaded model kept, its device share held and its idle time charged as warm-idle); "
        "0: a fresh process per run. None: 300 for inference kinds, else 0.")
    keep_warm_across_flow_runs: bool = Field(
        default=False, description="Keep a body warm for the next flow run too (a service answering flow after "
        "flow): it waits its whole keep_warm time. False: it ends once nothing of its key waits in its own flow "
        "run (after AISCHED_WARM_LINGER_SECONDS), so a map's idle time is the tail of its work.")

    @field_validator("keep_warm", mode="before")
    @classmethod
    def _keep_warm_seconds(cls, v: object) -> object:
        from datetime import timedelta

        return v.total_seconds() if isinstance(v, timedelta) else v

    @field_validator("time_limit", mode="before")
    @classmethod
    def _time_limit_words(cls, v: object) -> object:
        if v is None or (isinstance(v, str) and v.lower() in NO_LIMIT_WORDS) or (isinstance(v, float) and v == float("inf")):
            return None
        if v is True or v == "est_seconds":
            return "est_seconds"
        raise ValueError("time_limit is est_seconds (leave it out: the run's est_seconds is its limit, as Slurm's "
                         "--time) or None / 'unlimited' (no limit); to let a run go longer, raise est_seconds")

    @field_validator("gpu_type", mode="before")
    @classmethod
    def _types_as_tuple(cls, v: object) -> object:
        return tuple(v) if isinstance(v, list) else v

    @field_validator("gpus", "gpu_type")
    @classmethod
    def _resource_rules(cls, v: Any, info: Any) -> Any:
        """The resource layer's rule for this one field (smallest fraction, named types), reported on the field."""
        try:
            GPURequest(**{info.field_name: v})
        except ValidationError as exc:
            raise ValueError("; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())) from None
        return v

    @field_validator("kind")
    @classmethod
    def _kind_is_a_slug(cls, v: str) -> str:
        if not _KIND.match(v):
            raise ValueError("use a lowercase slug such as 'training', 'inference' or 'model-call'")
        return v

    @model_validator(mode="after")
    def _priceable(self) -> AIRequest:
        self.gpu_request()  # the resource layer's own rules: whole or fractional, types
        if self.gpus and self.est_seconds <= 0:
            raise ValueError(
                "est_seconds must be > 0 for a GPU task: it prices the budget hold (e.g. est_seconds=600)"
            )
        if self.hosts is not None and self.hosts > 1 and self.gpus < 1:
            raise ValueError("hosts > 1 needs whole gpus (a multiple of hosts): e.g. gpus=16, hosts=2")
        if (self.gpu_memory_gb or self.gpu_type) and not self.gpus:
            raise ValueError("gpu_memory_gb/gpu_type need gpus >= 1")
        if self.requeue_on_time_limit and self.time_limit is None:
            raise ValueError("requeue_on_time_limit=True needs a time limit: drop time_limit=None, or drop the requeue")
        if self.preemptible and self.gpus < 1:
            raise ValueError("preemptible=True needs gpus >= 1 (whole GPUs wait in the cluster's queue, "
                             "which is what stops and requeues a run); drop preemptible or ask for a whole GPU")
        return self

    @classmethod
    def build(cls, **fields: Any) -> AIRequest:
        """Validate, turning pydantic's error into one that names each field and its fix."""
        try:
            return cls(**fields)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'request'}: {e['msg'].removeprefix('Value error, ')} (got {e.get('input')!r})"
                for e in exc.errors()
            )
            raise InvalidAIRequest(f"invalid @ai_task request: {problems}") from None

    def gpu_request(self) -> GPURequest:
        try:
            return GPURequest(gpus=self.gpus, gpu_memory_gb=self.gpu_memory_gb, gpu_type=self.gpu_type, hosts=self.hosts)
        except ValidationError as exc:
            raise ValueError("; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())) from None

    @property
    def limit_seconds(self) -> float | None:
        """Its time limit in seconds (a GPU run's est_seconds), or None: no limit (or no GPUs: not limited)."""
        return self.est_seconds if self.time_limit == "est_seconds" and self.gpus else None

    @property
    def keep_warm_seconds(self) -> float:
        """How long this run's body may stay warm: what was declared, else the default of its kind."""
        if self.keep_warm is not None:
            return self.keep_warm
        return DEFAULT_KEEP_WARM_SECONDS if self.kind in WARM_KINDS else 0.0

    @cached_property
    def digest(self) -> str:
        """Hash of the request, binding tickets (and later approvals) to exactly what was asked."""
        return hashlib.sha256(json.dumps(self.model_dump(), sort_keys=True).encode()).hexdigest()
