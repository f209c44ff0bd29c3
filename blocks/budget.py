"""How much may be spent and what things cost: the budget an operator edits, and pricing."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import ClassVar, Literal

from prefect.blocks.core import Block
from pydantic import BaseModel, ConfigDict, Field

Period = Literal["daily", "weekly", "monthly", "total"]


class UnpriceableRequest(ValueError):
    """The budget has no price for something the run would use."""


class CostEstimate(BaseModel):
    """A priced run: its cost, and the prices that produced it (for the evidence)."""

    model_config = ConfigDict(frozen=True)

    amount: float = Field(ge=0)
    gpu_type_priced: str | None = None
    gpu_hour_price: float = 0.0
    token_price_per_1k: float = 0.0


def period_key(period: Period, now: datetime | None = None) -> str:
    """The calendar window a charge at `now` (UTC) falls into."""
    now = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
    if period == "daily":
        return now.strftime("%Y-%m-%d")
    if period == "weekly":
        year, week, _ = now.isocalendar()
        return f"{year}-W{week:02d}"
    if period == "monthly":
        return now.strftime("%Y-%m")
    return "total"


def _lookup(prices: dict[str, float], key: str) -> float | None:
    low = {k.lower(): v for k, v in prices.items()}
    return low.get(key.lower(), low.get("*"))


class BudgetBlock(Block):
    """A spending limit per period, with the prices that turn GPU-hours and tokens into money."""

    _block_type_name: ClassVar[str] = "AI Budget"
    _block_type_slug: ClassVar[str] = "aisched-budget"
    _logo_url = None
    _description: ClassVar[str] = "A money limit per period and the prices of GPU-hours and tokens, enforced by aisched-prefect's ledger."
    _documentation_url = "https://github.com/aisched/aisched-prefect#budgets"
    _code_example: ClassVar[str] = '''
```python
from blocks import BudgetBlock

budget = BudgetBlock(limit=500, period="monthly", gpu_hour_prices={"H100": 4.0, "A10": 1.0})
budget.save("team-a", overwrite=True)
budget = BudgetBlock.load("BLOCK_NAME")
```
'''

    limit: float = Field(ge=0, description="Most money that may be posted plus held in one period.")
    currency: str = Field(default="USD", description="Currency of the limit and of every price.")
    period: Period = Field(default="monthly", description="Calendar window the limit applies to (UTC): daily, weekly, monthly or total.")
    gpu_hour_prices: dict[str, float] = Field(default_factory=dict, description="Price of one GPU-hour by GPU type; the key '*' prices any other type.")
    token_prices_per_1k: dict[str, float] = Field(default_factory=dict, description="Price of 1,000 tokens by model; the key '*' prices any other model.")

    def gpu_hour_price(self, gpu_type: str) -> float:
        price = _lookup(self.gpu_hour_prices, gpu_type)
        if price is None:
            raise UnpriceableRequest(
                f"budget has no GPU-hour price for gpu_type={gpu_type!r}: add it to "
                f"gpu_hour_prices (known: {sorted(self.gpu_hour_prices)}), or a '*' price"
            )
        return price

    def estimate(
        self,
        gpus: float,
        seconds: float,
        gpu_types: list[str],
        tokens: int = 0,
        model: str | None = None,
    ) -> CostEstimate:
        """Price a run; with several candidate GPU types, the dearest (settled later at the real one)."""
        amount, priced, hour_price, tok_price = 0.0, None, 0.0, 0.0
        if gpus:
            if not gpu_types:
                raise UnpriceableRequest("no GPU type can hold this request, so it cannot be priced")
            hour_price, priced = max((self.gpu_hour_price(t), t) for t in gpu_types)
            amount += gpus * seconds / 3600.0 * hour_price
        if tokens:
            if model is None:
                raise UnpriceableRequest("the task declares est_tokens but no model=: set model= so tokens can be priced")
            price = _lookup(self.token_prices_per_1k, model)
            if price is None:
                raise UnpriceableRequest(
                    f"budget has no token price for model={model!r}: add it to token_prices_per_1k"
                )
            tok_price = price
            amount += tokens / 1000.0 * price
        return CostEstimate(amount=amount, gpu_type_priced=priced, gpu_hour_price=hour_price, token_price_per_1k=tok_price)

    def actual_cost(self, gpus: float, seconds: float, gpu_type: str | None, tokens: int = 0, model: str | None = None) -> float:
        """Cost of what a run really used."""
        return self.estimate(gpus, seconds, [gpu_type] if gpu_type else [], tokens, model).amount
