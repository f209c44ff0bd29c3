"""The facts about one run that the pure checks of this package look at."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class RunFacts(BaseModel):
    """What a run asks for, as an authority, budget or approval check sees it."""

    model_config = ConfigDict(frozen=True)

    principal: str
    kind: str
    tenant: str | None = None
    """Who pays: the runner's tenant=, else the principal up to its first '/'."""
    flow: str | None = None
    """Name of the Prefect flow the run belongs to."""
    flow_version: str | None = None
    first_of_version: bool = False
    """No run of this flow at this version has been admitted before (checked only when a rule asks)."""
    model: str | None = None
    gpus: float = Field(default=0, ge=0)
    gpu_types: tuple[str, ...] = ()
    """Every GPU type the run could land on (one when the task names one)."""
    est_seconds: float = Field(default=0, ge=0)
    est_tokens: int = Field(default=0, ge=0)
    est_cost: float | None = Field(default=None, ge=0)
