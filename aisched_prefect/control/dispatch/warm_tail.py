"""When a warm body ends by default: once nothing of its key waits in its own flow run.

A body kept warm for its whole keep-warm time (5 minutes for inference kinds) after a map's last shard idles many
times longer than the map ran: a 200-shard map of quarter-GPU shards left 16 bodies idle 5 minutes each, charged
as `warm-idle` several times the work it served. Idle time should be the tail of real work. So, unless the task
asked `keep_warm_across_flow_runs=True`, a body of flow run F and key K whose idle time has passed
`AISCHED_WARM_LINGER_SECONDS` ends when no run of K in F waits to be placed (more bodies idle than runs wait: the
ones idle longest end; the queue hands a waiting run to the most recently idle body). The linger covers a flow's
next call in a loop (sent as soon as the last result is back) and calls of a map still on their way.

Swept after each run's outcome (one sweep `linger` later, when the body it left may be past its linger), and again
a linger later while bodies it kept remain; the books (control.dispatch.warm) settle each ended period with the
seconds it idled. The idle start is the books' wall clock (their rows carry it across a restart), so is `now`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable

from aisched_prefect.control.dispatch.warm import WarmBooks, WarmIdle, warm_key

logger = logging.getLogger("aisched_prefect.control")
WHY = "nothing of its key waits in its flow run"
BUSY_FACTOR = 3  # the linger while runs of the key still run in the flow run (measured: a 200-shard map's flow
# sent a next shard more than 2 s after a result came back, on a loaded host, and 3 bodies were started again)


def excess(periods: list[WarmIdle], waiting: Callable[[str, str], int], linger: float, now: float,
           busy: Callable[[str, str], int] = lambda k, f: 0) -> list[str]:
    """The idle bodies to end now (pure): per (key, flow run), those past their linger beyond the runs that wait,
    the longest idle first; bodies that asked to stay warm across flow runs are never among them. While runs of the
    key still run in the flow run (`busy`: a map not done; its flow may send its next shard only as a result comes
    back), the linger is BUSY_FACTOR times longer."""
    groups: dict[tuple[str, str], list[WarmIdle]] = defaultdict(list)
    for p in periods:
        if not p.admission.request.keep_warm_across_flow_runs:
            groups[(warm_key(p.admission), p.admission.flow_run_id)].append(p)
    out: list[str] = []
    for (key, flow_run), idle in groups.items():
        spare = len(idle) - waiting(key, flow_run)
        wait = linger * (BUSY_FACTOR if busy(key, flow_run) else 1)
        for p in sorted(idle, key=lambda p: p.since)[:max(spare, 0)]:
            if now - p.since >= wait:
                out.append(p.body)
    return out


class WarmTail:
    """Ends the warm bodies nothing of their key waits for in their flow run (see the module's docstring)."""

    def __init__(self, books: WarmBooks, waiting: Callable[[], dict[tuple[str, str], tuple[int, int]]],
                 linger: Callable[[], float]) -> None:
        self.books, self._waiting, self._linger = books, waiting, linger
        self._armed = False  # a sweep is due for bodies left idle while something of their key waited
        self._lock = threading.Lock()

    def sweep(self) -> list[str]:
        """End the bodies that have nothing to wait for now; their ids. Bodies kept because a run of their key
        still waited are looked at again a linger later."""
        with self._lock:
            self._armed = False
        try:
            counts = self._waiting()
            periods = self.books.idle_periods()  # `since` on the plane's wall clock (rows carry it across restarts)
            ended = excess(periods, lambda k, f: counts.get((k, f), (0, 0))[0], self._linger(), time.time(),
                           lambda k, f: counts.get((k, f), (0, 0))[1])
            out = self.books.end_idle(ended, WHY) if ended else []
        except Exception:  # a sweep that failed leaves bodies to their keep-warm time: charged, never lost
            logger.exception("could not end warm bodies nothing waits for")
            return []
        if any(not p.admission.request.keep_warm_across_flow_runs and p.body not in ended for p in periods):
            with self._lock:
                again, self._armed = not self._armed, True
            if again:
                self.after()
        return out

    def after(self, seconds: float | None = None) -> None:
        """Sweep once the body a run just left may be past its linger."""
        timer = threading.Timer((self._linger() if seconds is None else seconds) + 0.05, self.sweep)
        timer.daemon = True
        timer.start()
