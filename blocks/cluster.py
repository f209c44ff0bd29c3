"""Settings of the cluster a team shares: limits on model calls, and the queue's tenant weights."""

from __future__ import annotations

import fnmatch
import hashlib
import re
from typing import ClassVar

from prefect.blocks.core import Block
from pydantic import BaseModel, ConfigDict, Field, model_validator


class ModelLimit(BaseModel):
    """How hard `model=` tasks of kind "model-call" may hit one model or endpoint, across every flow run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="Model name or glob ('gpt-4o', 'gpt-*'); every model it matches shares the limit.")
    concurrency: int | None = Field(default=None, ge=1, description="Most calls in flight at once.")
    per_minute: float | None = Field(default=None, gt=0, description="Most calls started per minute, evenly spaced.")

    @model_validator(mode="after")
    def _says_something(self) -> ModelLimit:
        if self.concurrency is None and self.per_minute is None:
            raise ValueError(f"model limit {self.model!r}: set concurrency, per_minute, or both")
        return self

    def matches(self, model: str) -> bool:
        return fnmatch.fnmatchcase(model.lower(), self.model.lower())

    @property
    def slug(self) -> str:
        """A Prefect concurrency-limit-safe name for this limit."""
        readable = re.sub(r"[^a-z0-9._-]+", "-", self.model.lower()).strip("-") or "model"
        return f"aisched-model-{readable}-{hashlib.sha256(self.model.encode()).hexdigest()[:6]}"


class ClusterBlock(Block):
    """What every flow run on a shared cluster must respect, edited in the Prefect UI."""

    _block_type_name: ClassVar[str] = "AI Cluster"
    _block_type_slug: ClassVar[str] = "aisched-cluster"
    _logo_url = None
    _description: ClassVar[str] = "Limits on model calls shared by every flow run on a cluster, enforced by aisched-prefect."
    _documentation_url = "https://github.com/aisched/aisched-prefect/blob/main/docs/how-to/ai-tasks.md"
    _code_example: ClassVar[str] = '''
```python
from blocks import ClusterBlock, ModelLimit

cluster = ClusterBlock(model_limits=[ModelLimit(model="gpt-*", concurrency=8, per_minute=500)])
cluster.save("shared", overwrite=True)
cluster = ClusterBlock.load("BLOCK_NAME")
```
'''

    model_limits: list[ModelLimit] = Field(default_factory=list, description="Per-model concurrency and rate limits; the first that matches applies.")
    tenant_weights: dict[str, float] = Field(
        default_factory=dict,
        description="Weighted fair share in the cluster's queue (runner queue=True): a tenant's share and quota are its "
                    "weight's part among the tenants active lately; a tenant not listed weighs 1.")

    @model_validator(mode="after")
    def _positive_weights(self) -> "ClusterBlock":
        bad = {t: w for t, w in self.tenant_weights.items() if not w > 0}
        if bad:
            raise ValueError(f"tenant_weights {bad}: every weight must be above 0 (leave a tenant out to weigh 1)")
        return self

    def limit_for(self, model: str | None) -> ModelLimit | None:
        if model is None:
            return None
        return next((lim for lim in self.model_limits if lim.matches(model)), None)
