"""The price of the idle time a run may leave behind: part of what the run costs.

A run whose body stays warm (dask_gpu.worker.bodies) leaves an idle period charged as `warm-idle`: its device share for up
to its keep-warm time. Before, a run was priced without it: under `max_cost_per_run 0.10` a run priced 0.056 (nobody
asked) left a 0.667 idle hold. Now:

- **`max_cost_per_run` caps the run and its idle time together.** The keep-warm time is cut so that the run's
  estimate and the idle time it may leave fit the smallest `max_cost_per_run` of its grant chain. The run itself
  must still fit (as before); the idle time, an optional speed-up, is what gives way: a run that fits its cap is
  never refused for idle time it may not use (most of it is not: a map's bodies end once nothing of their key waits,
  control.dispatch.warm_tail).
- **The price the approval rules read (`min_cost`) and a person sees is the run plus that idle time.**

The idle hold taken when the run ends (control.warm) is for the capped time at the GPU type it ran on, at most the
dearest type it was priced at: never more than priced here.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from aisched_prefect.request import AIRequest
from blocks import BudgetBlock, Grant


class IdlePrice(BaseModel):
    """The idle time a run may leave behind, and its price."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    asked_seconds: float = Field(default=0.0, ge=0)  # what the task asked (keep_warm), at most the plane's setting
    seconds: float = Field(default=0.0, ge=0)  # what it may have: cut to fit max_cost_per_run
    cost: float = Field(default=0.0, ge=0)  # its price, in the budget's currency
    per_hour: float = Field(default=0.0, ge=0)  # the run's GPU share for an hour, at the type it was priced at
    capped_by: str | None = None  # the grant whose max_cost_per_run cut it

    def words(self, currency: str) -> str:
        """One line a person reads: 'up to 300 s warm idle, 0.0417 USD' (and why it is shorter than asked)."""
        if self.asked_seconds <= 0:
            return "none (the body ends with its run)"
        cut = (f" (asked {self.asked_seconds:g} s; cut to fit max_cost_per_run of grant {self.capped_by!r})"
               if self.capped_by else "")
        return f"up to {self.seconds:.0f} s warm idle, {self.cost:.4f} {currency}{cut}"


def warm_eligible(request: AIRequest) -> bool:
    """Runs whose body may stay warm: one host, a GPU share, not preemptible (control.settlement.keep_warm)."""
    return request.gpus > 0 and not request.preemptible and (request.hosts or 1) <= 1


def idle_price(budget: BudgetBlock, request: AIRequest, types: list[str], run_cost: float, chain: list[Grant],
               max_keep_seconds: float) -> IdlePrice:
    """The idle time a run may leave and its price, cut so the run and it fit every grant's max_cost_per_run."""
    asked = min(request.keep_warm_seconds, max_keep_seconds) if warm_eligible(request) else 0.0
    if asked <= 0:
        return IdlePrice()
    per_hour = budget.estimate(request.gpus, 3600.0, types).amount
    if per_hour <= 0:  # a free GPU type: idle time costs nothing
        return IdlePrice(asked_seconds=asked, seconds=asked)
    seconds, capped_by = asked, None
    for grant in chain:
        room = max(grant.max_cost_per_run - run_cost, 0.0) / per_hour * 3600
        if room < seconds:
            seconds, capped_by = room, grant.id
    return IdlePrice(asked_seconds=asked, seconds=seconds, cost=per_hour * seconds / 3600, per_hour=per_hour,
                     capped_by=capped_by)
