"""When a warm body ends by default: once nothing of its key waits in its own flow run.

A body kept warm for its whole keep-warm time (5 minutes for inference kinds) after a map's last shard idles many
times longer than the map ran: a 200-shard map of quarter-GPU shards left 16 bodies idle 5 minutes each, charged
as `warm-idle` several times the work it served. Idle time should be the tail of real work. So, unless the task
asked `keep_warm_across_flow_runs=True`, a body of flow run F and key K whose idle time has passed
`AISCHED_WARM_LINGER_SECONDS` ends when no run of K in F waits to be placed (more bodies idle than runs wait: the
ones idle longest end; the queue hands a waiting run to the most recently idle body). The linger covers a flow's
next call in a loop (sent as soon as the last result is back) and calls of a map still on their way.

A map's shards its flow has not sent yet count as waiting (`Arrivals`): a flow sends a `.map()`'s shards as
Prefect's task engines start them, so a queue faster than the flow runs dry mid-map, and ending its bodies then
loads the model again for the rest (a 1,000-shard map loaded it 30 to 36 times on 16 quarter-GPU places).

Swept by one thread (`after` asks for a sweep `linger` from now, when the body a run just left may be past its
linger), and again a linger later while bodies it kept remain; the books (control.dispatch.warm) settle each ended
period with the seconds it idled. The idle start is the books' wall clock (their rows carry it across a restart),
so is `now`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from aisched_prefect.control.dispatch.warm import WarmBooks, WarmIdle, warm_key

logger = logging.getLogger("aisched_prefect.control")
WHY = "nothing of its key waits in its flow run"
MAP_QUIET_SECONDS = 60.0  # a map none of whose shards arrived for this long is not waited for (its flow went away)
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


@dataclass
class _Map:
    """What has arrived of one map: the shard indexes, its size, the warm key and flow run of its admitted shards."""

    size: int
    last: float
    seen: set[int] = field(default_factory=set)
    where: tuple[str, str] | None = None


class Arrivals:
    """The shards of each `.map()` its flow has not sent yet, by (warm key, flow run): work an idle body of that key
    still has (the module's docstring). The size is the flow's word; it only keeps that flow's own bodies warm, at
    its principal's charge and within their keep-warm time. A map is known by its flow run (the caller's own, the
    call book checked) and its id, so no other flow's calls count as its shards."""

    def __init__(self, quiet_seconds: float = MAP_QUIET_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.quiet, self.clock = quiet_seconds, clock
        self._maps: dict[tuple[str, str], _Map] = {}
        self._lock = threading.Lock()

    def arrived(self, array: str, index: int, size: int | None, key: str | None, flow_run: str) -> None:
        """Shard `index` of map `array` reached the plane (admitted, refused or waiting for a person); `key`: its
        warm key where it was admitted."""
        if size is None:
            return
        now = self.clock()
        with self._lock:
            m = self._maps.get((flow_run, array))
            if m is None:  # a new map: forget the quiet ones (their flows went away mid-map)
                self._drop_quiet(now)
                m = self._maps[(flow_run, array)] = _Map(size, now)
            m.seen.add(index)
            m.last = now
            if key is not None and m.where is None:
                m.where = (key, flow_run)
            if len(m.seen) >= m.size:
                del self._maps[(flow_run, array)]

    def to_come(self) -> dict[tuple[str, str], int]:
        """Shards not sent yet, by (warm key, flow run), of the maps a shard of which arrived lately."""
        out: dict[tuple[str, str], int] = defaultdict(int)
        with self._lock:
            self._drop_quiet(self.clock())
            for m in self._maps.values():
                if m.where is not None:
                    out[m.where] += m.size - len(m.seen)
        return dict(out)

    def _drop_quiet(self, now: float) -> None:
        for name in [n for n, m in self._maps.items() if now - m.last > self.quiet]:
            del self._maps[name]


class WarmTail:
    """Ends the warm bodies nothing of their key waits for in their flow run (see the module's docstring)."""

    def __init__(self, books: WarmBooks, waiting: Callable[[], dict[tuple[str, str], tuple[int, int]]],
                 linger: Callable[[], float]) -> None:
        self.books, self._waiting, self._linger = books, waiting, linger
        self._due: float | None = None  # when the sweeper thread sweeps next (monotonic), None: not asked
        self._wake = threading.Condition()
        self._sweeper: threading.Thread | None = None

    def sweep(self) -> list[str]:
        """End the bodies that have nothing to wait for now; their ids. Bodies kept because a run of their key
        still waited are looked at again a linger later."""
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
            self.after()  # bodies kept because something of their key waited: looked at again a linger later
        return out

    def after(self, seconds: float | None = None) -> None:
        """Sweep once the body a run just left may be past its linger: one thread sweeps at the earliest time asked
        (a timer thread per run had a 1,000-shard map's plane at 1,000 threads)."""
        due = time.monotonic() + (self._linger() if seconds is None else seconds) + 0.05
        with self._wake:
            if self._due is None or due < self._due:
                self._due = due
                self._wake.notify()
            if self._sweeper is None:
                self._sweeper = threading.Thread(target=self._sweep_when_due, name="aisched-warm-tail", daemon=True)
                self._sweeper.start()

    def _sweep_when_due(self) -> None:
        while True:
            with self._wake:
                while self._due is None or self._due > time.monotonic():
                    self._wake.wait(None if self._due is None else self._due - time.monotonic())
                self._due = None
            self.sweep()
