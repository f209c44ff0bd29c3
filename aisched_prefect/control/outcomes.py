"""Finished runs' replies on their way to the flow process that submitted them: one long-poll per flow process.

A flow process submits its calls (`POST /v1/runs`, many per request) and gets
them back here as they end (`GET /v1/outcomes`): waiting is state on both
sides, never a thread or a connection per run. Each flow process names a
*session* (a random id its runner chose); an outcome is kept until the session
acknowledges it (its next poll's `after` is past it), so a poll cut by a proxy
or a dropped connection loses nothing and delivers nothing twice. A session that
stops polling for `lease_seconds` is abandoned: what it still has waiting in the
cluster's queue is taken out (`on_abandoned`), and its runs that already run
finish and are settled as usual.

Blocking callers (`POST /v1/calls`, one call per request) wait on `wait_one`.

A large result never comes through here: its worker keeps it (dask_gpu.worker.results),
the settlement records its digest and size (`result_evidence`), and the reply
carries the reference the flow fetches it with (`direct_reply`).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aisched_prefect.wire import DirectResult, Reply


@dataclass
class _Kept:
    seq: int
    key: str
    reply: Reply
    out: bytes


@dataclass
class _Session:
    who: str
    seen: float
    pending: set[str] = field(default_factory=set)  # keys submitted and not yet ended
    ready: list[_Kept] = field(default_factory=list)  # ended, not yet acknowledged (in seq order)
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(default_factory=list)


def result_digest(out: bytes) -> str:
    """The digest a result's bytes are checked against before they are unpickled (sha256, hex).

    >>> result_digest(b"")[:12]
    'e3b0c44298fc'
    """
    return hashlib.sha256(out).hexdigest()


def result_evidence(value: bytes, kept: Any = None) -> dict[str, Any]:
    """What a completed run's settlement records of its result: its digest, its size and which way it travels
    (`kept`: the worker's `ResultRef`, whose bytes the control plane never sees); never the token that fetches it.

    >>> result_evidence(b"abc")["result_bytes"]
    3
    """
    if kept is not None:
        return {"result_digest": kept.digest, "result_bytes": kept.size, "result_via": "worker"}
    return {"result_digest": result_digest(value), "result_bytes": len(value), "result_via": "control-plane"}


def direct_reply(kept: Any) -> dict[str, Any]:
    """The fields of a completed reply whose result stays on its worker (none for a result sent inline)."""
    if kept is None:
        return {}
    return {"result_digest": kept.digest, "result_ref": DirectResult.model_validate(kept.model_dump())}


class OutcomeBook:
    """Which session waits for which call, and the outcomes each has not acknowledged yet."""

    def __init__(self, lease_seconds: float, on_abandoned: Callable[[list[str]], None] | None = None,
                 on_gone: Callable[[set[str]], None] | None = None) -> None:
        self.lease_seconds = lease_seconds
        self.on_abandoned = on_abandoned
        self.on_gone = on_gone  # callers (`who`) that have no session left at all
        self._lock = threading.Lock()
        self._seq = 0
        self._sessions: dict[str, _Session] = {}
        self._session_of: dict[str, str] = {}  # call key -> session
        self._blocking: dict[str, tuple[threading.Event, list[tuple[Reply, bytes]]]] = {}
        self._closing = False

    # -- who waits --------------------------------------------------------------------------
    def expect(self, key: str, session: str | None, who: str) -> None:
        """`key` was accepted: its outcome goes to `session` (None: a blocking caller waits with `wait_one`)."""
        with self._lock:
            if session is None:
                self._blocking.setdefault(key, (threading.Event(), []))
                return
            s = self._session(session, who)
            s.pending.add(key)
            self._session_of[key] = session

    def holds(self, session: str, key: str) -> bool:
        """Whether `session` still has `key` coming (pending, or ended and not yet acknowledged): a submit of it
        sent again (its first answer was cut) re-attaches to it instead of being told its result is lost."""
        with self._lock:
            s = self._sessions.get(session)
            return s is not None and (key in s.pending or any(k.key == key for k in s.ready))

    def owns(self, session: str, who: str) -> bool:
        """Whether `session` is `who`'s (a session id another principal chose is refused)."""
        with self._lock:
            s = self._sessions.get(session)
            return s is None or s.who == who

    def _session(self, session: str, who: str) -> _Session:
        s = self._sessions.get(session)
        if s is None:
            s = self._sessions[session] = _Session(who=who, seen=time.monotonic())
        s.seen = time.monotonic()
        return s

    # -- ended --------------------------------------------------------------------------------
    def put(self, key: str, reply: Reply, out: bytes) -> None:
        """A call ended: hand its outcome to whoever waits for it."""
        with self._lock:
            blocking = self._blocking.get(key)
            if blocking is not None:
                blocking[1].append((reply, out))
                blocking[0].set()
                return
            session = self._session_of.pop(key, None)
            s = self._sessions.get(session) if session is not None else None
            if s is None:  # nobody waits (its session was abandoned): the call book keeps the reply
                return
            s.pending.discard(key)
            self._seq += 1
            s.ready.append(_Kept(self._seq, key, reply, out))
            waiters, s.waiters = s.waiters, []
            if waiters:  # its poll was open until now; the woken poll ends later (`_done_waiting`), and in between
                s.seen = time.monotonic()  # `expire` must not count the lease from when that poll began
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    def wait_one(self, key: str, timeout: float | None = None) -> tuple[Reply, bytes] | None:
        with self._lock:
            event, box = self._blocking.setdefault(key, (threading.Event(), []))
        if not event.wait(timeout):
            return None
        with self._lock:
            self._blocking.pop(key, None)
        return box[0]

    async def take(self, session: str, who: str, after: int, wait: float, max_bytes: int) -> tuple[list[_Kept], int]:
        """Outcomes of `session` past `after` (those up to `after` are acknowledged and dropped), waiting up to
        `wait` seconds for one; and how many of its calls are still pending."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + wait
        while True:
            event = asyncio.Event()
            with self._lock:
                s = self._session(session, who)
                s.ready = [k for k in s.ready if k.seq > after]
                out, size = [], 0
                for k in s.ready:
                    if out and size + len(k.out) > max_bytes:
                        break
                    out.append(k)
                    size += len(k.out)
                pending = len(s.pending)
                left = deadline - time.monotonic()
                if out or left <= 0 or self._closing:
                    return out, pending
                s.waiters.append((loop, event))
            try:
                await asyncio.wait_for(event.wait(), left)
            except asyncio.TimeoutError:
                pass
            finally:  # this poll no longer waits (it timed out, was woken or cancelled): the session is seen now
                self._done_waiting(session, loop, event)

    def _done_waiting(self, session: str, loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
        """Forget a poll's waiter. Why: `expire` keeps a session that has a poll open; a waiter left behind by a poll
        that timed out would keep a flow process that died after it alive until one of its runs ended, and its
        runs waiting in the queue would wait on (and start) for nobody."""
        with self._lock:
            s = self._sessions.get(session)
            if s is None:
                return
            s.seen = time.monotonic()
            try:
                s.waiters.remove((loop, event))
            except ValueError:  # `put` took it to wake it
                pass

    def close(self) -> None:
        """The plane is stopping: every long-poll answers now with what it has (the flow polls again, or another
        replica), instead of being cut by the server's graceful-shutdown timeout mid-request."""
        with self._lock:
            self._closing = True
            waiters = [w for s in self._sessions.values() for w in s.waiters]
            now = time.monotonic()
            for s in self._sessions.values():
                if s.waiters:  # polling until now (as in `put`)
                    s.seen = now
                s.waiters = []
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    # -- sessions that went away -----------------------------------------------------------------
    def expire(self) -> list[str]:
        """Forget sessions that stopped polling; returns the keys they still had pending (and tells `on_abandoned`)."""
        now = time.monotonic()
        abandoned: list[str] = []
        ended: set[str] = set()
        with self._lock:
            for sid, s in list(self._sessions.items()):
                if now - s.seen > self.lease_seconds and not s.waiters:
                    abandoned.extend(s.pending)
                    ended.add(s.who)
                    for key in s.pending:
                        self._session_of.pop(key, None)
                    del self._sessions[sid]
            gone = ended - {s.who for s in self._sessions.values()}
        if abandoned and self.on_abandoned is not None:
            self.on_abandoned(abandoned)
        if gone and self.on_gone is not None:
            self.on_gone(gone)
        return abandoned

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"sessions": len(self._sessions), "pending": sum(len(s.pending) for s in self._sessions.values()),
                    "unacknowledged": sum(len(s.ready) for s in self._sessions.values()),
                    "blocking": len(self._blocking)}
