"""Budget alerts: a budget crossing 50, 80 or 100 % of its limit (posted plus held) fires once per upward crossing."""

from __future__ import annotations

from typing import Any

from aisched_prefect.ledger.amounts import from_micros
from aisched_prefect.ledger.records import BudgetAlert

ALERT_THRESHOLDS = (50, 80, 100)  # percent of a limit used (posted + held)
ALERT_REARM_POINTS = 5  # an alert fires again only after use fell this many points below it


def crossed(changed: list[Any]) -> list[BudgetAlert]:
    """The thresholds these accounts crossed upwards since they last alerted; re-arms those that fell back."""
    alerts: list[BudgetAlert] = []
    for acct in changed:
        if acct.limit <= 0:
            continue
        used = acct.pending + acct.posted
        level = max((t for t in ALERT_THRESHOLDS if used * 100 >= t * acct.limit), default=0)
        if level > acct.alerted:
            for t in ALERT_THRESHOLDS:
                if acct.alerted < t <= level:
                    alerts.append(BudgetAlert(
                        budget=acct.budget, period=acct.period, unit=acct.unit, threshold=t,
                        used=used / acct.limit, limit=from_micros(acct.limit),
                        posted=from_micros(acct.posted), pending=from_micros(acct.pending)))
            acct.alerted = level
        elif level < acct.alerted and used * 100 < (acct.alerted - ALERT_REARM_POINTS) * acct.limit:
            acct.alerted = level
    return alerts
