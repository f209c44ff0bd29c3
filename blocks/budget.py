"""How much may be spent and what things cost: the budgets an operator edits, and pricing.

A `BudgetBlock` holds prices and a tree of limits. Each limit counts one unit
(money, GPU-hours or tokens) for one scope (everyone, a tenant, a principal, a
flow, a model or a GPU type) per period (daily, weekly, monthly or total;
calendar windows in UTC, or rolling ones). A run must fit every limit that
covers it, and every limit above those in the tree; `lines` says which.
"""

from __future__ import annotations

import fnmatch
import re
from datetime import datetime, timezone
from typing import Annotated, ClassVar, Literal

from prefect.blocks.core import Block
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from blocks.facts import RunFacts

Period = Literal["daily", "weekly", "monthly", "total"]
Unit = Literal["money", "gpu-hours", "tokens"]
Scope = Literal["all", "tenant", "principal", "flow", "model", "gpu-type"]
Window = Literal["calendar", "rolling"]

ROLLING_SECONDS: dict[str, float] = {"daily": 86_400.0, "weekly": 7 * 86_400.0, "monthly": 30 * 86_400.0}
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")

MAX_AMOUNT = 1e12
"""The largest limit, amount or price the books hold, in any unit: its micro-units fit a signed 64-bit integer."""

Amount = Annotated[float, Field(ge=0, le=MAX_AMOUNT, allow_inf_nan=False)]
"""A limit, an amount or a price: finite, 0 or more, at most MAX_AMOUNT (NaN, inf and negatives are refused)."""


class UnpriceableRequest(ValueError):
    """The budget has no price for something the run would use."""


class CostEstimate(BaseModel):
    """A priced run: its cost, and the prices that produced it (for the evidence)."""

    model_config = ConfigDict(frozen=True)

    amount: float = Field(ge=0, allow_inf_nan=False)
    gpu_type_priced: str | None = None
    gpu_hour_price: float = 0.0
    token_price_per_1k: float = 0.0


class Usage(BaseModel):
    """What a run used or will use, in every unit a budget can count."""

    model_config = ConfigDict(frozen=True)

    money: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    gpu_hours: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    tokens: float = Field(default=0.0, ge=0, allow_inf_nan=False)

    def of(self, unit: Unit) -> float:
        return {"money": self.money, "gpu-hours": self.gpu_hours, "tokens": self.tokens}[unit]


class BudgetLine(BaseModel):
    """One budget account a hold must fit: which account and window, its limit, and what this run takes."""

    model_config = ConfigDict(frozen=True)

    budget: str = Field(min_length=1, max_length=200)
    period: str = Field(min_length=1, max_length=32)
    limit: Amount
    amount: Amount = 0.0
    unit: Unit = "money"
    rolling_seconds: float | None = Field(default=None, gt=0, le=366 * 86_400.0, allow_inf_nan=False)
    """Rolling window: what was charged in the last this-many seconds counts, not a calendar period."""
    config_version: int | None = Field(default=None, ge=0, lt=2**63)
    """Version of the applied budget configuration this limit comes from (the control plane numbers
    them): the ledger keeps the newest version's limit, so a line from an older one never overwrites
    it. None: a line from no versioned configuration (the embedded runner's), which never overwrites
    a versioned limit."""


def period_key(period: Period, now: datetime | None = None, window: Window = "calendar") -> str:
    """The window a charge at `now` (UTC) falls into: a calendar period, or the name of a rolling one."""
    if window == "rolling":
        return f"rolling-{int(ROLLING_SECONDS[period] // 86_400)}d"
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


class BudgetLimit(BaseModel):
    """One limit of a BudgetBlock: how much of one unit one scope may use per period."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Short unique name, e.g. 'nightly-flow' (lowercase, digits, '.', '_', '-').")
    amount: Amount = Field(description="Most that may be posted plus held in one window, in `unit`.")
    unit: Unit = Field(default="money", description="money (the block's currency), gpu-hours or tokens.")
    period: Period = Field(default="monthly", description="daily, weekly, monthly or total.")
    window: Window = Field(default="calendar", description="calendar (UTC periods) or rolling (the last 1, 7 or 30 days).")
    scope: Scope = Field(default="all", description="What the limit is for: all, tenant, principal, flow, model or gpu-type.")
    match: str = Field(default="*", description="Which tenant/principal/flow/model/GPU type (glob, e.g. 'team-a' or 'gpt-*').")
    parent: str | None = Field(default=None, description="Name of the limit this one nests in: runs it covers must fit the parent too.")

    @field_validator("name")
    @classmethod
    def _name_is_a_slug(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"limit name {v!r}: use lowercase letters, digits, '.', '_' or '-' (e.g. 'team-a-monthly')")
        return v

    @model_validator(mode="after")
    def _rolling_needs_a_length(self) -> BudgetLimit:
        if self.window == "rolling" and self.period == "total":
            raise ValueError(f"limit {self.name!r}: a rolling window needs period daily, weekly or monthly, not total")
        if self.scope == "all" and self.match != "*":
            raise ValueError(f"limit {self.name!r}: match={self.match!r} needs a scope (tenant, principal, flow, model or gpu-type)")
        return self

    def covers(self, facts: RunFacts) -> bool:
        if self.scope == "all":
            return True
        values = {
            "tenant": [facts.tenant], "principal": [facts.principal], "flow": [facts.flow],
            "model": [facts.model], "gpu-type": list(facts.gpu_types),
        }[self.scope]
        return any(v is not None and fnmatch.fnmatchcase(v.lower(), self.match.lower()) for v in values)


class BudgetBlock(Block):
    """Prices of GPU-hours and tokens, and the nested limits aisched-prefect's ledger enforces."""

    _block_type_name: ClassVar[str] = "AI Budget"
    _block_type_slug: ClassVar[str] = "aisched-budget"
    _logo_url = None
    _description: ClassVar[str] = (
        "Limits in money, GPU-hours or tokens per tenant, principal, flow, model or GPU type, and the prices "
        "of GPU-hours and tokens, enforced by aisched-prefect's ledger.")
    _documentation_url = "https://github.com/aisched/aisched-prefect/blob/main/docs/how-to/budgets.md"
    _code_example: ClassVar[str] = '''
```python
from blocks import BudgetBlock, BudgetLimit

budget = BudgetBlock(
    limit=500, period="monthly", gpu_hour_prices={"H100": 4.0, "A10": 1.0},
    limits=[BudgetLimit(name="nightly", scope="flow", match="nightly-*", amount=100, parent=None),
            BudgetLimit(name="h100-hours", unit="gpu-hours", scope="gpu-type", match="H100", amount=80)],
)
budget.save("team-a", overwrite=True)
budget = BudgetBlock.load("BLOCK_NAME")
```
'''

    limit: Amount | None = Field(default=None, description="Most money everyone under this block may post plus hold per period; empty for none.")
    currency: str = Field(default="USD", description="Currency of money limits and of every price.")
    period: Period = Field(default="monthly", description="Calendar window (UTC) of `limit`: daily, weekly, monthly or total.")
    limits: list[BudgetLimit] = Field(default_factory=list, description="Further limits: per tenant, principal, flow, model or GPU type, nested by `parent`.")
    gpu_hour_prices: dict[str, Amount] = Field(default_factory=dict, description="Price of one GPU-hour by GPU type; the key '*' prices any other type.")
    token_prices_per_1k: dict[str, Amount] = Field(default_factory=dict, description="Price of 1,000 tokens by model; the key '*' prices any other model.")

    @model_validator(mode="after")
    def _limits_form_a_tree(self) -> BudgetBlock:
        by_name: dict[str, BudgetLimit] = {}
        for lim in self.limits:
            if lim.name in by_name:
                raise ValueError(f"limits: two limits are named {lim.name!r}; give each a unique name")
            by_name[lim.name] = lim
        for lim in self.limits:
            seen, node = {lim.name}, lim
            while node.parent is not None:
                parent = by_name.get(node.parent)
                if parent is None:
                    raise ValueError(f"limits[{node.name!r}].parent: no limit is named {node.parent!r} "
                                     f"(known: {sorted(by_name)})")
                if parent.unit != node.unit:
                    raise ValueError(f"limits[{node.name!r}]: counts {node.unit} but its parent {parent.name!r} "
                                     f"counts {parent.unit}; nest limits of the same unit")
                if node.amount > parent.amount:
                    raise ValueError(f"limits[{node.name!r}].amount={node.amount} is more than its parent "
                                     f"{parent.name!r} allows ({parent.amount}); lower it or raise the parent")
                if parent.name in seen:
                    raise ValueError(f"limits[{lim.name!r}]: parents form a cycle through {parent.name!r}")
                seen.add(parent.name)
                node = parent
        return self

    def gpu_hour_price(self, gpu_type: str) -> float:
        price = _lookup(self.gpu_hour_prices, gpu_type)
        if price is None:
            raise UnpriceableRequest(
                f"budget has no GPU-hour price for gpu_type={gpu_type!r}: add it to "
                f"gpu_hour_prices (known: {sorted(self.gpu_hour_prices)}), or a '*' price"
            )
        return price

    def token_price(self, model: str | None) -> float:
        if model is None:
            raise UnpriceableRequest("the task declares est_tokens but no model=: set model= so tokens can be priced")
        price = _lookup(self.token_prices_per_1k, model)
        if price is None:
            raise UnpriceableRequest(f"budget has no token price for model={model!r}: add it to token_prices_per_1k")
        return price

    def estimate(
        self,
        gpus: float,
        seconds: float,
        gpu_types: list[str],
        tokens: float = 0,
        model: str | None = None,
    ) -> CostEstimate:
        """Price a run; with several candidate GPU types, the dearest (settled later at the real one)."""
        amount, priced, hour_price, tok_price = self._price(gpus, seconds, gpu_types, tokens, model)
        if not amount <= MAX_AMOUNT:  # also NaN: a run the books cannot hold is refused, not overflowed
            raise UnpriceableRequest(
                f"this run would cost {amount:g} (gpus={gpus:g}, {seconds:g} s, {tokens:g} tokens), more than a "
                f"budget can hold ({MAX_AMOUNT:g}): lower gpus, est_seconds or est_tokens, or check the prices")
        return CostEstimate(amount=amount, gpu_type_priced=priced, gpu_hour_price=hour_price, token_price_per_1k=tok_price)

    def _price(self, gpus: float, seconds: float, gpu_types: list[str], tokens: float,
               model: str | None) -> tuple[float, str | None, float, float]:
        amount, priced, hour_price, tok_price = 0.0, None, 0.0, 0.0
        if gpus:
            if not gpu_types:
                raise UnpriceableRequest("no GPU type can hold this request, so it cannot be priced")
            hour_price, priced = max((self.gpu_hour_price(t), t) for t in gpu_types)
            amount += gpus * seconds / 3600.0 * hour_price
        if tokens:
            tok_price = self.token_price(model)
            amount += tokens / 1000.0 * tok_price
        return amount, priced, hour_price, tok_price

    def actual_cost(self, gpus: float, seconds: float, gpu_type: str | None, tokens: float = 0, model: str | None = None) -> float:
        """Cost of what a run really used (however much: a charge above the holds posts only what budgets have left)."""
        return self._price(gpus, seconds, [gpu_type] if gpu_type else [], tokens, model)[0]

    def account(self, name: str, limit: BudgetLimit | None = None) -> str:
        """The ledger account of the block's own limit (its name), or of one of its limits."""
        return name if limit is None else f"{name}/{limit.name}"

    def lines(self, name: str, facts: RunFacts, usage: Usage, now: datetime | None = None,
              config_version: int | None = None) -> list[BudgetLine]:
        """Every account a run must fit, with what it would take from each: covering limits and their parents.

        `config_version`: the version of this block as the control plane applied it, stamped on each line.
        """
        out: list[BudgetLine] = []
        if self.limit is not None:
            out.append(BudgetLine(budget=name, period=period_key(self.period, now), limit=self.limit,
                                  amount=usage.money, unit="money", config_version=config_version))
        by_name = {lim.name: lim for lim in self.limits}
        chosen: dict[str, BudgetLimit] = {}
        for lim in self.limits:
            if lim.covers(facts):
                node: BudgetLimit | None = lim
                while node is not None and node.name not in chosen:
                    chosen[node.name] = node
                    node = by_name.get(node.parent) if node.parent else None
        for lim in self.limits:  # block order: what `budget show` lists
            if lim.name in chosen:
                out.append(self._line(name, lim, usage.of(lim.unit), now, config_version))
        return out

    def limit_lines(self, name: str, now: datetime | None = None, config_version: int | None = None) -> list[BudgetLine]:
        """Every account of the block with its limit and nothing taken: what `Ledger.apply_limits` applies."""
        out = [] if self.limit is None else [BudgetLine(budget=name, period=period_key(self.period, now), limit=self.limit,
                                                        unit="money", config_version=config_version)]
        return out + [self._line(name, lim, 0.0, now, config_version) for lim in self.limits]

    def _line(self, name: str, lim: BudgetLimit, amount: float, now: datetime | None, version: int | None) -> BudgetLine:
        return BudgetLine(budget=self.account(name, lim), period=period_key(lim.period, now, lim.window), limit=lim.amount,
                          amount=amount, unit=lim.unit, config_version=version,
                          rolling_seconds=ROLLING_SECONDS[lim.period] if lim.window == "rolling" else None)
