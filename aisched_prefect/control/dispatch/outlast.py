"""Writes to the books that must outlast a ledger outage: a run's settlement and a warm body's idle settlement.

Why one piece: both settle holds that are idempotent to settle again (settling twice changes nothing and records
nothing), and both would otherwise leave their holds to expire charged in full when the database restarts for a few
seconds just as the write is made. The ledger's own retries (under a second) ride out a dropped connection, not a
restart of 3-5 s; this waits, in growing pauses, for up to `patience` seconds (callers bound it by the holds' lease:
past it the holds expire anyway). A local queue of settlements would outlast longer outages but is a second book of
money beside the ledger.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from aisched_prefect.errors import LedgerUnavailable
from aisched_prefect.ledger.engine import retryable

logger = logging.getLogger("aisched_prefect.control")
T = TypeVar("T")
FIRST_PAUSE = 0.1
LONGEST_PAUSE = 2.0


def unreachable(exc: BaseException) -> bool:
    """The ledger's database did not answer (an outage, a dropped connection, a commit of unknown outcome)."""
    return isinstance(exc, LedgerUnavailable) or retryable(exc)


def outlasting(write: Callable[[], T], *, patience: float, what: str, sleep: Callable[[float], Any] = time.sleep) -> T:
    """`write()`, again while the ledger is unreachable, for up to `patience` seconds; its value. Any other error,
    or the outage outlasting the patience, is raised. `what` names the write in the log ("AI task x (admission y)
    ended", "the idle time of warm body z")."""
    deadline = time.monotonic() + patience
    pause = FIRST_PAUSE
    while True:
        try:
            return write()
        except Exception as exc:
            if not unreachable(exc) or time.monotonic() + pause > deadline:
                raise
            logger.warning("%s but the ledger is unreachable; settling it again in %.1fs (for up to %.0fs): %s",
                           what, pause, patience, exc)
            sleep(pause)
            pause = min(pause * 2, LONGEST_PAUSE)
