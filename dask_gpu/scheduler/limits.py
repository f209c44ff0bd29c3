"""Per-model call limits where the queue lives: on the scheduler, shared by every client of the cluster.

A model or endpoint allows so many calls in flight (`concurrency`) and so many
starts a minute (`per_minute`). Polling a counter with back-off (as Prefect's
global concurrency limits do) starts calls in bursts and falls short of the
rate; here each start gets its own slot time, 60/per_minute apart, in the order
calls asked: a burst of N calls runs at exactly the configured rate.

Concurrency slots are first come, first served: a call that finds the limit
full queues (under the key it chose) and a slot that comes free passes straight
to the first in line, so no later call takes it in between. A wait is asked in
short turns (`wait` seconds), so the caller can give up between them (its
authority ended): `cancel` takes it out of the line, or gives back the slot
handed to it meanwhile. Slots in flight are counted per client, and a client
that goes away gives its slots (and its place in line) back.

    >>> import asyncio
    >>> limits = ModelLimits()
    >>> async def three():
    ...     return [await limits.acquire("m", per_minute=60, concurrency=None, client="c", wait=0) for _ in range(3)]
    >>> [round(s["delay"]) for s in asyncio.run(three())]
    [0, 1, 2]
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

PLUGIN_NAME = "dask-gpu-model-limits"
RELEASE_STREAM_OP = "gpu-limit-release"  # a call ended: sent on the client's batched stream, no round trip


class ModelLimits(SchedulerPlugin):
    """Slots of every model limit: calls in flight (a FIFO line of waiters) and the next start time of each rate."""

    name = PLUGIN_NAME
    idempotent = True  # a second control plane (a replica) keeps the first one's slots

    def __init__(self) -> None:
        self._next: dict[str, float] = {}  # limit -> the earliest start of the next call (wall clock)
        self._held: dict[str, dict[str, int]] = {}  # limit -> client -> calls in flight
        self._line: dict[str, OrderedDict[tuple[str, str], asyncio.Future]] = {}  # limit -> (client, key) -> waiter
        self._concurrency: dict[str, int] = {}  # limit -> calls it allows in flight (as the latest call said)

    async def start(self, scheduler: Any) -> None:
        scheduler.handlers["gpu_limit_acquire"] = self.acquire
        scheduler.handlers["gpu_limit_release"] = self.release
        scheduler.handlers["gpu_limit_cancel"] = self.cancel
        scheduler.handlers["gpu_limit_status"] = self.status
        if hasattr(scheduler, "stream_handlers"):
            scheduler.stream_handlers[RELEASE_STREAM_OP] = self._release_stream

    def _release_stream(self, name: str, client: str | None = None, unrate: float | None = None,
                        per_minute: float | None = None, **kwargs: Any) -> None:
        """A call ended; `unrate`: the rate slot of a call that never started, to give back (`unrate`). One op for
        both: a scheduler whose plugin predates a field ignores it (an unknown op would close the client's stream)."""
        if client is not None:
            self.release(name, client)
        if unrate is not None and per_minute is not None:
            self.unrate(name, unrate, per_minute)

    def unrate(self, name: str, slot: float, per_minute: float) -> None:
        """A call that will not start (its authority ended while it waited) gives its rate slot back, if it was
        the last one handed out; later slots stay where they are (their calls were told their times)."""
        if self._next.get(name) == slot + 60.0 / per_minute:
            self._next[name] = slot

    def _in_flight(self, name: str) -> int:
        return sum(self._held.get(name, {}).values())

    def _take(self, name: str, client: str) -> None:
        held = self._held.setdefault(name, {})
        held[client] = held.get(client, 0) + 1

    def _start_at(self, name: str, per_minute: float | None) -> dict[str, float]:
        """This call's start slot: `delay`, seconds from now (0 without a rate), and `slot`, the scheduler's wall
        clock then; the next slot moves 60/per_minute on."""
        now = time.time()
        if per_minute is None:
            return {"delay": 0.0, "slot": now}
        start = max(now, self._next.get(name, now))
        self._next[name] = start + 60.0 / per_minute
        return {"delay": start - now, "slot": start}

    async def acquire(self, name: str, per_minute: float | None, concurrency: int | None, client: str,
                      wait: float = 1.0, key: str | None = None) -> dict[str, float] | None:
        """Take a slot: when this call may start (`_start_at`: its rate slot), or None if no concurrency slot came
        to it within `wait` (it keeps its place in line: ask again with the same `key`, or `cancel`)."""
        if concurrency is not None:
            self._concurrency[name] = concurrency
            line = self._line.setdefault(name, OrderedDict())
            k = (client, key or uuid.uuid4().hex)
            fut = line.get(k)
            if fut is None:
                if self._in_flight(name) < concurrency and all(f.done() for f in line.values()):
                    self._take(name, client)  # room, and nobody waits before it
                    return self._start_at(name, per_minute)
                fut = line[k] = asyncio.get_running_loop().create_future()
                self._hand_over(name)
            if not fut.done():
                try:
                    await asyncio.wait_for(asyncio.shield(fut), timeout=wait)
                except asyncio.TimeoutError:
                    return None
            line.pop(k, None)  # the slot was handed over (counted to its client already)
            return self._start_at(name, per_minute)
        self._take(name, client)
        return self._start_at(name, per_minute)

    def cancel(self, name: str, client: str, key: str) -> None:
        """A waiter gives up: out of the line, and a slot handed to it meanwhile goes to the next in line."""
        fut = self._line.get(name, OrderedDict()).pop((client, key), None)
        if fut is not None and fut.done():
            self.release(name, client)

    def release(self, name: str, client: str) -> None:
        """A call ended: its slot passes to the first in line, or is free."""
        held = self._held.get(name, {})
        if held.get(client, 0) > 0:
            held[client] -= 1
            if held[client] == 0:
                del held[client]
            self._hand_over(name)

    def _hand_over(self, name: str) -> None:
        """Free slots pass to the first waiters in line (counted to their clients at once: nobody barges in)."""
        line = self._line.get(name)
        limit = self._concurrency.get(name)
        if not line or limit is None:
            return
        for (client, _), fut in line.items():
            if self._in_flight(name) >= limit:
                return
            if not fut.done():  # (a done one was handed a slot already and has not come back for it yet)
                self._take(name, client)
                fut.set_result(None)

    def status(self) -> dict[str, Any]:
        """Calls in flight and waiting per limit, and the next rate slot (seconds from now)."""
        now = time.time()
        names = set(self._held) | set(self._line) | set(self._next)
        return {n: {"in_flight": self._in_flight(n), "waiting": sum(not f.done() for f in self._line.get(n, {}).values()),
                    "next_slot_in": max(self._next[n] - now, 0.0) if n in self._next else None} for n in sorted(names)}

    def remove_client(self, scheduler: Any, client: str) -> None:
        for name in list(set(self._held) | set(self._line)):
            freed = self._held.get(name, {}).pop(client, 0)
            line = self._line.get(name, OrderedDict())
            for k in [k for k in line if k[0] == client]:
                fut = line.pop(k)
                if not fut.done():  # (a slot handed over and never taken is counted in its held slots)
                    fut.cancel()
            if freed:
                self._hand_over(name)


def install_limits(client: Any) -> None:
    """Put the model limits on the client's scheduler (once; later calls keep the one there)."""
    client.register_plugin(ModelLimits(), name=PLUGIN_NAME)
