"""Ctrl-C and SIGTERM reach a flow's approval waits at once, not after Prefect's crash handling.

A stopped flow withdraws what it waits for (issue 32). The exception a signal raises in the flow's main thread
travels through Prefect's task and flow engines first, which report the crash to the Prefect API (retried when
the server is slow) before the runner's exit closes the session; on a loaded host that took more than 30 s,
while the desk's thread kept polling the plane, so its request stayed held. The handler here only notes the
signal on the desk (one attribute: a signal handler must not take locks) and hands the signal on to the handler
it replaced; the desk's own thread withdraws within one poll.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Callable

WHY = {signal.SIGINT: "the flow was interrupted (Ctrl-C)", signal.SIGTERM: "the flow process was terminated (SIGTERM)"}


class StopSignals:
    """While entered (from the main thread), SIGINT and SIGTERM call `noted(why)` and then the handler they had."""

    def __init__(self, noted: Callable[[str], None]) -> None:
        self.noted = noted
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # elsewhere Python refuses signal handlers
            for signum in WHY:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:  # a handler installed after ours stays
                signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        try:
            self.noted(WHY[signum])
        finally:
            previous = self._previous.get(signum, signal.SIG_DFL)
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:  # what the signal would have done without us
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
