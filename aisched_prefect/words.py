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
