"""A flow's wait for a person, shown in Prefect: one line saying who, what and where, and a pause that says why.

The wait itself is at the control plane (its page proves who answered). Prefect shows it as a pause whose state
message is the reason and the link, and whose form explains that it has nothing to fill in. When the plane has an
answer, the pause is resumed from here. An answer typed into the Prefect form is reported to the plane (recorded,
not counted), said in the run's log, and the run pauses again.

A flow that stops waiting withdraws its requests (their budget is released; a late answer is told the run is
gone): the session's close on Ctrl-C or SIGTERM (`PauseDesk.stop`), and a Prefect cancellation of the paused run,
seen here within a poll.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Any

from aisched_prefect.approvals import ApprovalInput
from prefect.exceptions import Pause

from aisched_prefect.errors import ApprovalWithdrawn
from aisched_prefect.flow.client import ControlPlaneError
from aisched_prefect.wire import ApprovalView
from aisched_prefect.words import time_left, who_may_approve

logger = logging.getLogger("aisched_prefect")
OPEN = ("pending", "suspended")


def run_log() -> Any:
    """The run's logger (console and the Prefect UI), or this module's outside a run."""
    try:
        from prefect.logging import get_run_logger

        return get_run_logger()
    except Exception:
        return logger


def say_waiting(view: ApprovalView) -> None:
    """One line in the flow's log (console and Prefect UI) saying who must answer, what, and where: the person who
    started the flow otherwise saw only Prefect's "Pausing flow"."""
    who = (f"{view.approvals_required} approvers" if view.approvals_required > 1 else "an approver")
    if view.approvers:  # a request filed by an older plane names nobody: the line stays as it was
        who += f" ({who_may_approve(view.approvers)})"
    signed = ", signed with their key" if view.require_signature else ""
    until = datetime.fromtimestamp(view.deadline, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    run_log().warning("AI task %r waits for %s%s (approval rule %r, %.4f %s held): answer at %s or with `aisched "
                      "approve %s --reason ...`; open until %s, when silence denies it", view.task_name, who, signed,
                      view.rule, view.est_cost, view.currency, view.url, view.id[:8], until)


def pause_message(views: list[ApprovalView]) -> str:
    """The pause's state message (what the Prefect run page shows beside "Paused"): why, and where to answer."""
    first = views[0]
    what = (f"AI task {first.task_name!r} waits" if len(views) == 1
            else f"{len(views)} AI task runs wait ({sum(v.est_cost for v in views):.4f} {first.currency} together)")
    return (f"{what} for approval: answer at {first.url} or with `aisched approve {first.id[:8]}`; "
            "the Resume form of this page does not count")


class ApprovalSuspended(Pause):
    """A deployment run was suspended to wait for a person; its process exits and the run resumes on the answer.

    Not a failure: a Prefect Pause (not an Exception), so the flow run is Suspended (it holds no process and no
    budget), its step is drawn Suspended, and the run re-runs from the start on its work pool when resumed.
    """


class PauseDesk:
    """Waits for people's answers at the control plane, showing the wait as one Prefect pause per flow run."""

    def __init__(self, session: Any) -> None:
        """`session`: the flow run's RunnerSession (its `client` is what the desk talks to)."""
        self.session = session
        self._waiting: dict[str, ApprovalView] = {}
        self._sharers: dict[str, int] = {}  # how many runs wait on each request (a map's shards share one)
        self._lock = threading.Lock()
        self._leading = False
        self._stop = threading.Event()
        self._stopping = threading.Lock()
        self._why = ""
        self._interrupted: str | None = None
        self._signalled = threading.Event()  # set only by the signal handler (never elsewhere in the main thread)
        self._watcher: threading.Thread | None = None

    # -- one run's wait ---------------------------------------------------------------------------
    def wait(self, view: ApprovalView, *, deployment: bool = False) -> ApprovalView:
        client = self.session.client
        if deployment:
            say_waiting(view)
            return self._suspend(view)
        with self._lock:  # the shards of a `.map()` wait on the map's one request: said once, withdrawn once
            sharers = self._sharers[view.id] = self._sharers.get(view.id, 0) + 1
            self._waiting[view.id] = view
        if sharers == 1:
            say_waiting(view)
        with self._lock:
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name="aisched-approval-signals", daemon=True)
                self._watcher.start()
        try:
            while True:
                current = client.approval(view.id)
                if current.status == "withdrawn" or (current.status in OPEN and self._stop.is_set()):
                    raise ApprovalWithdrawn(f"AI task {view.task_name!r}: its approval request was withdrawn ("
                                            f"{current.reason or self._why}); its budget is released. Fix: run the "
                                            "flow again to ask again")
                if current.status not in OPEN:
                    return current
                with self._lock:
                    lead = not self._leading
                    self._leading = self._leading or lead
                if lead:
                    try:
                        self._pause_once()
                    finally:
                        with self._lock:
                            self._leading = False
                else:
                    client.approval(view.id, wait=2.0)
        finally:
            with self._lock:
                self._sharers[view.id] -= 1
                if not self._sharers[view.id]:
                    del self._sharers[view.id]
                    self._waiting.pop(view.id, None)

    def interrupt(self, why: str) -> None:
        """Ctrl-C or SIGTERM, called from the signal handler in the main thread: the desk's watcher withdraws at
        once, while Prefect's crash handling runs there (it reports to the Prefect API first, slowly under load).
        Safe in a handler: the main thread takes `_signalled`'s lock nowhere else."""
        self._interrupted = why
        self._signalled.set()

    def _watch(self) -> None:
        """Withdraw on a signal; a thread only while this session waits for people."""
        while not self._stop.is_set():
            if self._signalled.wait(0.5):
                self.stop(self._interrupted or "the flow was stopped by a signal")
                return
            with self._lock:
                if not self._waiting:
                    self._watcher = None
                    return

    def stop(self, why: str) -> None:
        """The flow stops waiting: withdraw every open request of this session (their holds released at once) and
        end the waits. Called on a signal, by the session's close (the flow ended) and on a cancellation; a second
        call waits for the first's withdrawals (the session closes its client after)."""
        with self._stopping:
            if self._stop.is_set():
                return
            self._why = why
            self._stop.set()
            with self._lock:
                ids = list(self._waiting)
            for approval_id in ids:
                try:
                    self.session.client.post(f"/v1/approvals/{approval_id}/withdraw", {"reason": why})
                except ControlPlaneError as exc:  # the plane withdraws it anyway once the flow stops polling
                    logger.warning("could not withdraw approval request %s: %s", approval_id, exc)
            if ids:
                logger.warning("withdrew %d approval request(s): %s", len(ids), why)

    def _describe(self) -> str:
        with self._lock:
            views = list(self._waiting.values())
        if len(views) == 1:
            return views[0].describe
        total = sum(v.est_cost for v in views)
        head = (f"**{len(views)} AI task runs of this flow run wait for approval** ({total:.4f} {views[0].currency} "
                f"together): the page of any of them answers them all at once: [{views[0].url}]({views[0].url})")
        return "\n\n---\n\n".join([head, *(v.describe for v in views)])

    # -- the Prefect pause ------------------------------------------------------------------------
    def _pause_once(self) -> None:
        """Pause the flow run (its state message the reason and link) until the plane has an answer, someone
        resumes it in Prefect, it is cancelled, the session stops, or the earliest deadline passes."""
        from prefect.client.orchestration import get_client
        from prefect.context import FlowRunContext
        from prefect.input.run_input import keyset_from_paused_state
        from prefect.states import Paused
        from prefect.utilities.engine import propose_state_sync

        ctx = FlowRunContext.get()
        assert ctx is not None and ctx.flow_run is not None
        flow_run_id = ctx.flow_run.id
        self._stop.wait(0.5)  # calls that ask at about the same time (a .map()) are shown, and answered, together
        with self._lock:
            views = list(self._waiting.values())
        if not views or self._stop.is_set():
            return
        deadline = min(v.deadline for v in views) + 2
        state = Paused(timeout_seconds=max(1, int(deadline - time.time())), reschedule=False,
                       pause_key=f"aisched-approval-{uuid.uuid4().hex[:12]}", message=pause_message(views))
        form = ApprovalInput.with_initial_data(description=self._describe())
        keyset = keyset_from_paused_state(state)
        state.state_details.run_input_keyset = keyset
        with get_client(sync_client=True) as prefect:
            state = propose_state_sync(prefect, state, flow_run_id=flow_run_id)
            if not state.is_paused():
                return
            form.save(keyset)
            if not self._paused(prefect, flow_run_id, form, keyset, deadline):
                return
        self._resume(flow_run_id, "the pause ended without an answer")  # stop or deadline: the run goes on to end

    def _paused(self, prefect: Any, flow_run_id: Any, form: Any, keyset: Any, deadline: float) -> bool:
        """Poll the plane (round-robin, one long-poll at a time) and the run's state; False once the pause is over
        (answered, resumed in Prefect, cancelled), True if it must still be lifted (stopped, deadline)."""
        turn = 0
        while time.time() < deadline and not self._stop.is_set():
            with self._lock:
                ids = list(self._waiting)
            if not ids:
                break
            decided = self.session.client.approval(ids[turn % len(ids)], wait=0.5)
            turn += 1
            now = prefect.read_flow_run(flow_run_id).state
            if now is not None and (now.is_cancelling() or now.is_cancelled() or now.is_final()):
                self.stop(f"the flow run was {now.name.lower()} in Prefect")
                return False
            if now is not None and now.is_running():  # somebody used the Resume form: it proves nothing
                self._not_counted(form.load(keyset, flow_run_id=flow_run_id))
                return False
            if decided.status not in OPEN:
                self._resume(flow_run_id, f"decided at the control plane: {decided.status}", decided)
                return False
        return True

    @staticmethod
    def _resume(flow_run_id: Any, reason: str, decided: ApprovalView | None = None) -> None:
        from prefect.flow_runs import resume_flow_run

        try:
            resume_flow_run(flow_run_id, run_input={
                "approve": decided is not None and decided.status == "approved",
                "approver": (decided.decided_by if decided else None) or "control plane", "reason": reason})
        except Exception:  # resumed, cancelled or crashed meanwhile: nothing left to lift
            logger.debug("could not resume flow run %s", flow_run_id, exc_info=True)

    def _not_counted(self, answer: Any) -> None:
        with self._lock:
            ids = list(self._waiting)
            url = next(iter(self._waiting.values())).url if self._waiting else "its link"
        for i in ids:
            try:
                self.session.client.post(f"/v1/approvals/{i}/unverified", answer.model_dump(mode="json"))
            except ControlPlaneError:
                pass
        run_log().warning("an answer sent with Prefect's Resume form was not counted (Prefect cannot tell who sent "
                          "it): answer on the control plane's page, %s, or with `aisched approve`; the run pauses "
                          "again", url)

    def _suspend(self, view: ApprovalView) -> ApprovalView:
        """A deployment run: release the holds, suspend the flow run (its process exits), re-run on the answer."""
        from prefect.context import FlowRunContext
        from prefect.flow_runs import suspend_flow_run

        client = self.session.client
        current = client.approval(view.id)
        if current.status not in OPEN:
            return current
        client.post(f"/v1/approvals/{view.id}/suspend")
        ctx = FlowRunContext.get()
        assert ctx is not None and ctx.flow_run is not None
        suspend_flow_run(wait_for_input=ApprovalInput.with_initial_data(description=view.describe),
                         flow_run_id=ctx.flow_run.id, timeout=max(1, int(view.deadline - time.time())),
                         key=f"aisched-approval-{view.id}")
        current = client.approval(view.id)
        if current.status in OPEN:
            why = (f"suspended until a person answers the approval of {view.task_name!r} at {view.url} (open "
                   f"{time_left(view.deadline)}); the flow run then re-runs on its work pool")
            raise ApprovalSuspended(f"flow run {view.flow_run_id} is {why}", state=self._suspended(why))
        return current

    @staticmethod
    def _suspended(why: str) -> Any:
        """Draw the step Suspended, not Failed (the task engine leaves a Pause's state as it is), and return the
        flow run's Suspended state, which the flow engine takes from the Pause."""
        from prefect.client.orchestration import get_client
        from prefect.context import FlowRunContext, TaskRunContext
        from prefect.states import Suspended

        with get_client(sync_client=True) as prefect:
            task = TaskRunContext.get()
            if task is not None:
                prefect.set_task_run_state(task.task_run.id, Suspended(message=why), force=True)
            ctx = FlowRunContext.get()
            return prefect.read_flow_run(ctx.flow_run.id).state if ctx and ctx.flow_run else None
