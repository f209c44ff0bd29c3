"""What a running AI task reports it used: tokens and provider cost, for settlement.

`report_usage` is called inside the task body, in the body's own process on
its worker: each report travels back with the result (never through the flow
process), and the control plane charges their sum. Reports are checked here and
again by the control plane; a body can only report, never settle.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from aisched_prefect.errors import InvalidUsage, NoAdmissionContext


MAX_REPORTED = 1e15


class ReportedUsage(BaseModel):
    """The sum of every `report_usage` call of one task run."""

    model_config = ConfigDict(frozen=True)

    tokens: int = Field(default=0, ge=0, le=MAX_REPORTED)
    input_tokens: int = Field(default=0, ge=0, le=MAX_REPORTED)
    output_tokens: int = Field(default=0, ge=0, le=MAX_REPORTED)
    cost: float | None = Field(default=None, ge=0, le=MAX_REPORTED, allow_inf_nan=False)
    """Money the provider charged, when the call reports it; else tokens are priced by the budget."""
    calls: int = Field(default=0, ge=0, le=MAX_REPORTED)


def report_usage(*, tokens: int | None = None, input_tokens: int = 0, output_tokens: int = 0,
                 cost: float | None = None) -> None:
    """Report what one model call used; settlement charges the sum instead of the estimate.

    `tokens` defaults to input_tokens + output_tokens. `cost` is the provider's
    charge in the budget's currency; without it, tokens are priced by the
    BudgetBlock's token_prices_per_1k.
    """
    from dask_gpu.body.child import report

    for name, value in (("tokens", tokens), ("input_tokens", input_tokens), ("output_tokens", output_tokens), ("cost", cost)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and 0 <= value <= MAX_REPORTED):
            raise InvalidUsage(f"report_usage({name}={value!r}): usage must be a finite number from 0 to "
                               f"{MAX_REPORTED:g}. Fix: report what the call used")
        if name != "cost" and value != int(value):
            raise InvalidUsage(f"report_usage({name}={value!r}): tokens are counted in whole tokens. Fix: pass an int")
    tokens, input_tokens, output_tokens = (None if tokens is None else int(tokens)), int(input_tokens), int(output_tokens)
    total = tokens if tokens is not None else input_tokens + output_tokens
    usage = ReportedUsage(tokens=total, input_tokens=input_tokens, output_tokens=output_tokens, cost=cost, calls=1)
    if not report({"usage": usage.model_dump()}):
        raise NoAdmissionContext("report_usage() is called inside an @ai_task's body, while it runs on its worker")


def reported(items: list[object]) -> ReportedUsage | None:
    """The usage a body's reports add up to, checked again on the control plane (a body can send anything).

    Raises InvalidUsage naming the first report that is not a valid usage report.
    """
    out: list[ReportedUsage] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidUsage(f"invalid usage report #{i + 1}: {str(item)[:200]!r} is not a report. Fix: report "
                               "usage only with report_usage()")
        if "usage" not in item:
            continue
        try:
            out.append(ReportedUsage.model_validate(item["usage"]))
        except Exception as exc:  # ValidationError, or a payload that is not even a mapping
            first = exc.errors()[0] if hasattr(exc, "errors") else {"loc": (), "msg": str(exc)}
            where = ".".join(str(x) for x in first.get("loc", ())) or "usage"
            raise InvalidUsage(f"invalid usage report #{i + 1}: {where}: {first.get('msg')} (got "
                               f"{str(item['usage'])[:200]}). Fix: report usage only with report_usage()") from None
    try:
        return summed(out)
    except ValueError:  # each report fits, their sum does not
        raise InvalidUsage(f"invalid usage reports: {len(out)} reports add up to more than {MAX_REPORTED:g}. Fix: "
                           "report what the calls used") from None


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
