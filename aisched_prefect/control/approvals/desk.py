"""The approvals desk: people's side of a call that needs a person.

A request is shown as it stands (a flow waits on its own, an approver or operator marks that someone still
waits for it); answers are counted here, a batch (one flow run's requests) whole or not at all, each
decision announced as a Prefect event, and a suspended deployment run is resumed once its answer is
recorded. The requests themselves, their links and signatures, are the ApprovalBook's (approvals.py); a
call's request is filed, and the approved call re-enters admission, in the admission pipeline (pipeline.py).
"""

from __future__ import annotations

import logging
import os
import time

from aisched_prefect.approvals import ApprovalDecision
from aisched_prefect.control.approvals.proof import ApprovalError
from aisched_prefect.control.approvals.waiters import Waiters
from aisched_prefect.control.approvals.requests import ApprovalBook, announce
from aisched_prefect.control.authority.credentials import Unauthorized, owns
from aisched_prefect.control.authority.identity import Credential
from aisched_prefect.control.authority.state import AuthorityState
from aisched_prefect.ledger import Ledger
from aisched_prefect.settings import Settings
from aisched_prefect.wire import ApprovalView

logger = logging.getLogger("aisched_prefect.control")


class ApprovalDesk:
    """Shows requests to people and counts their answers."""

    def __init__(self, ledger: Ledger, state: AuthorityState, settings: Settings, approvals: ApprovalBook,
                 waiters: Waiters) -> None:
        self.ledger, self.state, self.settings = ledger, state, settings
        self.approvals, self.waiters = approvals, waiters

    # -- people's side --------------------------------------------------------------------------
    def approval(self, caller: Credential, approval_id: str, wait: float = 0.0) -> ApprovalView:
        """A request as it stands, waiting up to `wait` seconds for it to be decided (a flow: only its own)."""
        deadline = time.monotonic() + min(wait, self.settings.approval_wait_seconds)
        marked = caller.role != "flow"
        while True:
            view = self.approvals.view(approval_id)
            if caller.role == "flow" and not owns(caller, self.approvals.admission(approval_id)):
                raise Unauthorized("this approval belongs to another principal", 403)
            if not marked and view.status == "pending":  # the flow that asked still waits for it
                self.waiters.seen(approval_id)
                marked = True
            if view.status not in ("pending", "suspended") or time.monotonic() >= deadline:
                return view
            time.sleep(0.2)

    def answer(self, caller: Credential | None, approval_id: str, decision: ApprovalDecision,
               items: list[str] | tuple[str, ...] = ()) -> ApprovalView:
        """Count an answer to one request, or to it and `items` together (one flow run's requests, a `.map()`):
        every item is proved first, so a batch counts whole or not at all."""
        ids = list(dict.fromkeys([approval_id, *items]))
        batch = ids if len(ids) > 1 else None
        if batch is not None:
            first = self.approvals.view(approval_id)
            for i in ids[1:]:
                other = self.approvals.view(i)
                if (other.flow_run_id, other.principal) != (first.flow_run_id, first.principal):
                    raise ApprovalError(f"approval {i} is not a request of flow run {first.flow_run_id}: one answer "
                                        "covers requests of one flow run", 400)
            for i in ids:
                self.approvals.check(i, decision, caller, batch)
        views = [self.approvals.answer(i, decision, caller, batch) for i in ids]
        decided = [v for v in views if v.status in ("approved", "rejected")]
        for view in decided:
            announce("aisched.approval.decided", view)
        if decided and len(decided) == len(views):  # one resume per flow run, once all are decided
            self._resume_if_suspended(decided[0], decision)
        return views[0]

    def _resume_if_suspended(self, view: ApprovalView, decision: ApprovalDecision) -> None:
        """A suspended deployment run waits for Prefect to resume it: do it, now that the answer is recorded."""
        if not self.approvals._row(view.id).suspended or not os.environ.get("PREFECT_API_URL"):
            return
        try:
            from prefect.flow_runs import resume_flow_run

            resume_flow_run(view.flow_run_id, run_input={"approve": view.status == "approved",
                                                         "approver": view.decided_by or "", "reason": decision.reason})
        except Exception:
            logger.exception("could not resume suspended flow run %s", view.flow_run_id)
