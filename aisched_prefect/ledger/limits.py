"""Limits, units and windows from the applied budget configuration, versioned.

A budget's limit is what the newest applied version of the configuration says,
never what some running flow happens to hold: a line (or an `apply_limits`)
of an older version than the one applied changes nothing, and a lowered limit
applies to the next reservation in every process, because each reservation
reads the budget's configuration in its own transaction. The trusted control
plane numbers the versions (`BudgetLine.config_version`, or the `version` of
`Ledger.apply_limits`). A line without a version (the embedded runner's) sets
its account's limit only while no version of that budget was ever applied.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

from aisched_prefect.errors import InvalidLedgerInput
from aisched_prefect.ledger.amounts import FEMTOS, MICROS, check_amount, femtos, to_micros
from aisched_prefect.ledger.records import LimitsApplied
from blocks import BudgetLine

UNITS = ("money", "gpu-hours", "tokens")
MAX_WINDOW_SECONDS = 366 * 86_400.0
NO_IDS = {"flow_run_id": None, "task_run_id": None, "principal": None}


def rolling_seconds(period: str) -> float | None:
    """The window of a rolling account ('rolling-7d' -> 7 days), or None for a calendar period."""
    return float(period.removeprefix("rolling-").removesuffix("d")) * 86_400.0 if period.startswith("rolling-") else None


class Config:
    """A budget's applied configuration: its limit (micro-units), unit, rolling window and version."""

    __slots__ = ("limit", "unit", "rolling", "version")

    def __init__(self, limit: int, unit: str, rolling: float | None, version: int) -> None:
        self.limit, self.unit, self.rolling, self.version = limit, unit, rolling, version

    def dump(self) -> dict[str, Any]:
        return {"limit": self.limit / MICROS, "unit": self.unit, "rolling_seconds": self.rolling, "version": self.version}


class Line(NamedTuple):
    """A budget line checked at the ledger's door: its account, configuration, and what it takes (micro-units)."""

    budget: str
    period: str
    unit: str
    limit: int
    rolling: float | None
    version: int | None
    want: int


def _name(what: str, value: object, longest: int) -> str:
    fix = "name the account (its budget name at most 200 characters, its period at most 32)"
    if not isinstance(value, str) or not value or len(value) > longest:
        raise InvalidLedgerInput(what, value, f"must be a name of 1 to {longest} characters", fix)
    if not value.isprintable():  # a NUL byte: Postgres cannot store it and SQLite would; control characters: unreadable
        raise InvalidLedgerInput(what, value, "a name has no NUL byte or other control character",
                                 "use letters, digits and punctuation in budget names")
    return value


def check_line(line: BudgetLine, what: str, amount: float | None = None) -> tuple[Line, int]:
    """One line, every field checked (a line may have been built or copied without validation).

    Returns the line and what it takes, in femto-units.
    """
    budget = _name(f"{what}.budget", line.budget, 200)
    period = _name(f"{what}.period", line.period, 32)
    if line.unit not in UNITS:
        raise InvalidLedgerInput(f"{what}.unit", line.unit, f"a budget counts one of {', '.join(UNITS)}",
                                 "use money, gpu-hours or tokens")
    limit = check_amount(f"{what}.limit", line.limit, fix="set the limit in the BudgetBlock to a number from 0 to 1e12")
    taken = check_amount(f"{what}.amount" if amount is None else "amount", line.amount if amount is None else amount,
                         fix="reserve a number from 0 to 1e12")
    rolling = line.rolling_seconds
    if rolling is not None and (isinstance(rolling, bool) or not isinstance(rolling, numbers.Real)
                                or not math.isfinite(rolling) or not 0 < rolling <= MAX_WINDOW_SECONDS):
        raise InvalidLedgerInput(f"{what}.rolling_seconds", rolling, "a window must be above 0 and at most 366 days",
                                 "use the BudgetLimit's period and window=rolling")
    version = line.config_version
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2**63):
        raise InvalidLedgerInput(f"{what}.config_version", version, "a version is a whole number from 0",
                                 "pass the version number of the applied configuration")
    return Line(budget, period, line.unit, to_micros(limit), None if rolling is None else float(rolling), version, 0), femtos(taken)


def checked_lines(lines: list[BudgetLine], amount: float | None = None) -> list[Line]:
    """The lines of one reservation, checked, one per account (the same account twice is one hold of the sum),
    in the one order every transaction takes accounts in."""
    by_key: dict[tuple[str, str], tuple[Line, int]] = {}
    for i, raw in enumerate(lines):
        line, taken = check_line(raw, f"lines[{i}]", amount)
        key = (line.budget, line.period)
        if key in by_key:
            taken += by_key[key][1]
        by_key[key] = (line, taken)
    return [line._replace(want=-(-taken // FEMTOS)) for _, (line, taken) in sorted(by_key.items())]


def apply_line(w: Any, acct: Any, line: Line) -> None:
    """Bring the account's limit, unit and window to the line, as far as the versions allow."""
    cfg = w.config(acct.budget)
    if line.version is not None and (cfg is None or line.version > cfg.version):
        new = Config(line.limit, line.unit, line.rolling, line.version)
        w.set_config(acct.budget, new)
        w.append("budget-limits", {"version": line.version, "source": "budget line", "stale": [],
                                   "changed": [{"budget": acct.budget, **new.dump(),
                                                "previous": cfg.dump() if cfg is not None else None}]}, NO_IDS)
        cfg = new
    if cfg is None and (acct.limit, acct.unit) != (line.limit, line.unit):
        acct.limit, acct.unit, acct.dirty = line.limit, line.unit, True
    w.set_window(acct, cfg.rolling if cfg is not None else line.rolling)


def apply_limits_op(lines: list[Line], version: int, by: str | None) -> Any:
    """A write that applies one version of the configuration: every budget it names whose stored version is older."""
    def op(w: Any) -> LimitsApplied:
        changed: list[dict[str, Any]] = []
        stale: list[str] = []
        for line in {line.budget: line for line in lines}.values():
            cfg = w.config(line.budget)
            new = Config(line.limit, line.unit, line.rolling, version)
            same = cfg is not None and (cfg.limit, cfg.unit, cfg.rolling) == (new.limit, new.unit, new.rolling)
            if cfg is not None and (cfg.version > version or (cfg.version == version and not same)):
                stale.append(line.budget)
                continue
            if cfg is not None and cfg.version == version:
                continue
            w.set_config(line.budget, new)
            if not same:
                changed.append({"budget": line.budget, **new.dump(), "previous": cfg.dump() if cfg is not None else None})
        record = None
        if changed or stale:
            record = w.append("budget-limits", {"version": version, "source": "apply", "by": by, "changed": changed,
                                                "stale": stale}, {**NO_IDS, "principal": by})
        return LimitsApplied(version=version, changed=[c["budget"] for c in changed], stale=stale, record=record)

    return op


def check_version(version: object) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2**63:
        raise InvalidLedgerInput("version", version, "a version is a whole number from 0",
                                 "pass the version number of the applied configuration")
    return version

