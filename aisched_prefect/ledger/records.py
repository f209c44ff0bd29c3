"""What the ledger hands back: holds, settlements, alerts, applied limits, and the refusal of a hold."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from aisched_prefect.errors import AISchedError
from aisched_prefect.evidence import EvidenceRecord
from aisched_prefect.ledger.amounts import from_micros


class BudgetExceeded(AISchedError):
    """A hold would take a budget past its limit."""

    def __init__(self, budget: str, period: str, limit: int, pending: int, posted: int, wanted: int,
                 unit: str = "money") -> None:
        self.budget, self.period, self.unit = budget, period, unit
        self.remaining = from_micros(limit - pending - posted)
        super().__init__(
            f"budget {budget!r} ({period}, {unit}) has {self.remaining:.4f} left of {from_micros(limit):.4f} "
            f"({from_micros(posted):.4f} posted, {from_micros(pending):.4f} held); this run needs "
            f"{from_micros(wanted):.4f}"
        )


class Hold(BaseModel):
    """A pending reservation on one budget account; `group` is the reservation it belongs to."""

    model_config = ConfigDict(frozen=True)

    id: str
    budget: str
    period: str
    reserved: float
    remaining_before: float
    remaining_after: float
    unit: str = "money"
    group: str | None = None


class Settlement(BaseModel):
    """What a hold became: charged amount, released rest, and whether this call did it."""

    model_config = ConfigDict(frozen=True)

    hold_id: str
    charged: float
    released: float
    uncovered: float = 0.0
    status: str
    first: bool
    budget: str | None = None
    unit: str = "money"


class BudgetAlert(BaseModel):
    """A budget crossed a threshold (percent of its limit posted plus held)."""

    model_config = ConfigDict(frozen=True)

    budget: str
    period: str
    unit: str
    threshold: int
    used: float
    limit: float
    posted: float
    pending: float


class LimitsApplied(BaseModel):
    """The outcome of applying one version of the budget configuration."""

    model_config = ConfigDict(frozen=True)

    version: int
    changed: list[str]
    """Budgets whose limit, unit or window this version set."""
    stale: list[str]
    """Budgets left as they were: a newer version (or this one, with other values) was applied before."""
    record: EvidenceRecord | None = None
