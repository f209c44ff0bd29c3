"""Times as a person reads them, shared by the plane's pages and the flow's log lines: '4 min 10 s', 'until
14:32:05 UTC (in 4 min 10 s)'."""

from __future__ import annotations

import time
from datetime import datetime, timezone


def duration_in_words(seconds: float) -> str:
    """'1 h 5 min', '4 min 10 s', '12 s'."""
    s = max(0, int(round(seconds)))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    if h:
        return f"{h} h {m} min" if m else f"{h} h"
    if m:
        return f"{m} min {sec} s" if sec else f"{m} min"
    return f"{sec} s"


def time_left(deadline: float, now: float | None = None) -> str:
    """The deadline as a time, and how long until it: 'until 14:32:05 UTC (in 4 min 10 s)'."""
    now = time.time() if now is None else now
    at = datetime.fromtimestamp(deadline, timezone.utc)
    when = at.strftime("%H:%M:%S UTC") if at.date() == datetime.fromtimestamp(now, timezone.utc).date() \
        else at.strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"until {when} (in {duration_in_words(deadline - now)})"


def who_may_approve(approvers: list[str], longest: int = 6) -> str:
    """Who may answer a request for approval, as the console line, the page and the form name them.

    >>> who_may_approve(["alice", "bob"])
    'alice or bob'
    >>> who_may_approve(["a", "b", "c", "d", "e", "f", "g", "h"])
    'one of a, b, c, d, e, f and 2 more (aisched approvals list shows the request to each)'
    >>> who_may_approve([])
    "nobody yet: no approver's grant covers this run (an operator grants one with can_approve)"
    """
    if not approvers:
        return "nobody yet: no approver's grant covers this run (an operator grants one with can_approve)"
    if len(approvers) == 1:
        return approvers[0]
    if len(approvers) <= longest:
        return ", ".join(approvers[:-1]) + f" or {approvers[-1]}"
    return (f"one of {', '.join(approvers[:longest])} and {len(approvers) - longest} more (aisched approvals list "
            "shows the request to each)")
