"""A signal reaches a flow's approval waits at once: the handler notes it and hands the signal on, and the desk's
own thread withdraws, without waiting for the main thread's exception to travel through Prefect's engines."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from aisched_prefect.flow.approval_wait import PauseDesk
from aisched_prefect.flow.signals import WHY, StopSignals
from tests.helpers import wait_until


def test_a_signal_is_noted_then_handed_to_the_handler_it_replaced_which_comes_back_after():
    noted: list[str] = []
    handed: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: handed.append(signum))
    # Python's own Ctrl-C handler is what StopSignals replaces in a script; another test of this worker may have left
    # a handler of its own on SIGINT (one that does not raise), so the test installs Python's, and puts back after.
    before_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with StopSignals(noted.append):
            os.kill(os.getpid(), signal.SIGTERM)
            wait_until(lambda: handed, 10, what="the replaced handler called")
            assert noted == [WHY[signal.SIGTERM]]
            with pytest.raises(KeyboardInterrupt):  # Ctrl-C still interrupts the flow, as Python's handler does
                os.kill(os.getpid(), signal.SIGINT)
                wait_until(lambda: False, 10, what="KeyboardInterrupt")
            assert noted == [WHY[signal.SIGTERM], WHY[signal.SIGINT]]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # both handed back on exit
        os.kill(os.getpid(), signal.SIGTERM)
        wait_until(lambda: len(handed) == 2, 10, what="the replaced handler called again")
        assert len(noted) == 2  # not noted once exited
    finally:
        signal.signal(signal.SIGTERM, before)
        signal.signal(signal.SIGINT, before_int)


def test_outside_the_main_thread_nothing_is_installed():
    seen: list[object] = []
    t = threading.Thread(target=lambda: seen.append(StopSignals(print).__enter__()._previous))
    t.start()
    t.join()
    assert seen == [{}]


class _Client:
    """The plane as the desk sees it: a request that stays pending until withdrawn."""

    def __init__(self) -> None:
        self.withdrawn: list[tuple[str, str]] = []
        self.status = "pending"
        self.polled = threading.Event()

    def approval(self, approval_id: str, wait: float = 0.0):
        from types import SimpleNamespace

        self.polled.set()
        if wait:
            threading.Event().wait(min(wait, 0.05))
        return SimpleNamespace(status=self.status, reason="withdrawn: " + (self.withdrawn[0][1] if self.withdrawn else ""))

    def post(self, path: str, body: dict | None = None):
        self.withdrawn.append((path, (body or {}).get("reason", "")))
        self.status = "withdrawn"


def test_an_interrupt_withdraws_from_the_desks_own_thread_while_the_wait_goes_on(monkeypatch):
    """The waiting thread is busy (here: a Prefect pause that never returns on its own); the interrupt alone, as
    a signal handler calls it, withdraws the request and ends the wait with ApprovalWithdrawn."""
    from types import SimpleNamespace

    from aisched_prefect.errors import ApprovalWithdrawn
    from aisched_prefect.flow import approval_wait

    client = _Client()
    desk = PauseDesk(SimpleNamespace(client=client))
    monkeypatch.setattr(approval_wait, "say_waiting", lambda view: None)
    pause_entered = threading.Event()

    def busy_pause() -> None:  # what a slow Prefect API looks like from here: the leader does not come back soon
        pause_entered.set()
        desk._stop.wait()

    monkeypatch.setattr(desk, "_pause_once", busy_pause)
    view = SimpleNamespace(id="a1", task_name="finetune")
    ended: list[BaseException] = []

    def waiting() -> None:
        try:
            desk.wait(view)
        except BaseException as exc:  # noqa: BLE001 - what the wait ended with is the test's subject
            ended.append(exc)

    t = threading.Thread(target=waiting)
    t.start()
    assert pause_entered.wait(10)
    desk.interrupt(WHY[signal.SIGINT])
    t.join(10)
    assert client.withdrawn == [("/v1/approvals/a1/withdraw", WHY[signal.SIGINT])]
    assert len(ended) == 1 and isinstance(ended[0], ApprovalWithdrawn), ended
    desk.stop("the flow run ended while it waited")  # the session's close after: nothing withdrawn twice
    assert len(client.withdrawn) == 1
