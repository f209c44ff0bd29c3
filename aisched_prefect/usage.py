"""What a running AI task reports it used: tokens and provider cost, for settlement.

`report_usage` is called inside the task body, on the Dask worker. The tally
lives in a context variable that `run_admitted` opens around the one call, so
reports of concurrent tasks on one worker never mix, and it travels back to
the flow process with the result.
"""

from __future__ import annotations

from contextvars import ContextVar

from pydantic import BaseModel, ConfigDict, Field

from aisched_prefect.errors import InvalidUsage, NoAdmissionContext


class ReportedUsage(BaseModel):
    """The sum of every `report_usage` call of one task run."""

    model_config = ConfigDict(frozen=True)

    tokens: int = Field(default=0, ge=0)
    input_tokens: int = Field(default=0, ge=0)
    output_tokens: int = Field(default=0, ge=0)
    cost: float | None = Field(default=None, ge=0)
    """Money the provider charged, when the call reports it; else tokens are priced by the budget."""
    calls: int = 0


_tally: ContextVar[list[ReportedUsage] | None] = ContextVar("aisched_usage", default=None)


def report_usage(*, tokens: int | None = None, input_tokens: int = 0, output_tokens: int = 0,
                 cost: float | None = None) -> None:
    """Report what one model call used; settlement charges the sum instead of the estimate.

    `tokens` defaults to input_tokens + output_tokens. `cost` is the provider's
    charge in the budget's currency; without it, tokens are priced by the
    BudgetBlock's token_prices_per_1k.
    """
    reports = _tally.get()
    if reports is None:
        raise NoAdmissionContext("report_usage() is called inside an @ai_task's body, while it runs")
    for name, value in (("tokens", tokens), ("input_tokens", input_tokens), ("output_tokens", output_tokens), ("cost", cost)):
        if value is not None and value < 0:
            raise InvalidUsage(f"report_usage({name}={value!r}): usage cannot be negative; report what the call used")
    total = tokens if tokens is not None else input_tokens + output_tokens
    reports.append(ReportedUsage(tokens=total, input_tokens=input_tokens, output_tokens=output_tokens, cost=cost, calls=1))


def open_tally() -> tuple[list[ReportedUsage], object]:
    """Start collecting reports for the call about to run in this context."""
    reports: list[ReportedUsage] = []
    return reports, _tally.set(reports)


def close_tally(token: object) -> None:
    _tally.reset(token)  # type: ignore[arg-type]


def summed(reports: list[ReportedUsage]) -> ReportedUsage | None:
    """One report for the run; None when the task reported nothing."""
    if not reports:
        return None
    costs = [r.cost for r in reports if r.cost is not None]
    return ReportedUsage(
        tokens=sum(r.tokens for r in reports), input_tokens=sum(r.input_tokens for r in reports),
        output_tokens=sum(r.output_tokens for r in reports),
        cost=sum(costs) if costs else None, calls=len(reports),
    )
