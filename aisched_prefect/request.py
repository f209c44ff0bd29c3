"""The immutable request an @ai_task declares: what it needs, what it is, what it will cost."""

from __future__ import annotations

import hashlib
import json
import re
from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from aisched_prefect.errors import InvalidAIRequest
from dask_gpu import GPURequest

_KIND = re.compile(r"^[a-z][a-z0-9-]*$")


class AIRequest(BaseModel):
    """What one run of an AI task asks for. Validated once, at decoration time."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str = Field(description="What the task does: training, inference, model-call, ...")
    gpus: float = Field(default=0, ge=0, le=64, description="Whole GPUs on one worker, or a fraction (0.25, 0.5) of one.")
    gpu_memory_gb: float | None = Field(
        default=None, gt=0, description="Whole GPUs: memory each must have. A fraction: memory reserved on the shared GPU.")
    gpu_type: str | tuple[str, ...] | None = Field(
        default=None, description="Required GPU type (H100, ...), or several acceptable ones; None = any.")
    model: str | None = Field(default=None, description="Model the task trains or calls.")
    est_seconds: float = Field(default=0, ge=0, description="Expected runtime; prices the budget hold.")
    est_tokens: int = Field(default=0, ge=0, description="Expected tokens; prices model calls.")
    priority: int = Field(default=0, ge=-100, le=100, description="Higher goes first.")
    preemptible: bool = Field(
        default=False, description="May borrow idle GPUs beyond its tenant's quota in the cluster's queue, and be "
        "stopped to give them back: charged for what ran, then queued again (it starts over unless it resumes "
        "from its own checkpoint). Needs whole GPUs and a runner with queue=True.")

    @field_validator("gpu_type", mode="before")
    @classmethod
    def _types_as_tuple(cls, v: object) -> object:
        return tuple(v) if isinstance(v, list) else v

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
        if (self.gpu_memory_gb or self.gpu_type) and not self.gpus:
            raise ValueError("gpu_memory_gb/gpu_type need gpus >= 1")
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
                f"{'.'.join(str(p) for p in e['loc']) or 'request'}: {e['msg']} (got {e.get('input')!r})"
                for e in exc.errors()
            )
            raise InvalidAIRequest(f"invalid @ai_task request: {problems}") from None

    def gpu_request(self) -> GPURequest:
        try:
            return GPURequest(gpus=self.gpus, gpu_memory_gb=self.gpu_memory_gb, gpu_type=self.gpu_type)
        except ValidationError as exc:
            raise ValueError("; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())) from None

    @cached_property
    def digest(self) -> str:
        """Hash of the request, binding tickets (and later approvals) to exactly what was asked."""
        return hashlib.sha256(json.dumps(self.model_dump(), sort_keys=True).encode()).hexdigest()
