"""The approvals desk: a call that needs a person, from its request to the one execution its approval allows.

A call whose rule asks for approval files a request here (announced as a Prefect event, so automations
can tell people); answers are counted here, a batch (one flow run's requests) whole or not at all, and
a suspended deployment run is resumed once its answer is recorded. The approved call then continues
here, after a fresh authority check, under the requester's credential only. The requests themselves,
their links and signatures, are the ApprovalBook's (approvals.py).
"""

from __future__ import annotations

import logging
import os
import time

from aisched_prefect.approvals import ApprovalDecision
from aisched_prefect.control import stages
from aisched_prefect.control.admission import Admission, Admitter, ApprovalNeeded
from aisched_prefect.control.approval_proof import ApprovalError
from aisched_prefect.control.approval_waiters import Waiters
from aisched_prefect.control.approvals import ApprovalBook
from aisched_prefect.control.credentials import Unauthorized, owns
from aisched_prefect.control.dispatch import Dispatcher
from aisched_prefect.control.identity import Credential
from aisched_prefect.control.state import AuthorityState
from aisched_prefect.errors import AdmissionDenied
from aisched_prefect.ledger import Ledger
from aisched_prefect.settings import Settings
from aisched_prefect.wire import ApprovalView, CallMeta, Reply

logger = logging.getLogger("aisched_prefect.control")


class ApprovalDesk:
    """Asks people, counts their answers, and admits the call an approval allows."""

    def __init__(self, ledger: Ledger, state: AuthorityState, settings: Settings, approvals: ApprovalBook,
                 admitter: Admitter, dispatcher: Dispatcher, waiters: Waiters) -> None:
        self.ledger, self.state, self.settings = ledger, state, settings
        self.approvals, self.admitter, self.dispatcher, self.waiters = approvals, admitter, dispatcher, waiters

    # -- a call that needs a person -------------------------------------------------------------
    def ask(self, need: ApprovalNeeded) -> Reply:
        """The request for a person a call's admission asked for (or the one already on file): its reply."""
        adm = need.admission
        if need.existing:  # the re-run of a suspended deployment run: its request holds its answer
            return Reply(status="approval-pending", admission=need.approval_id,
                         approval=self.approvals.view(need.approval_id))
        rec = self.ledger.records_about(adm.task_run_id)
        payload = next(r.payload for r in reversed(rec) if r.kind == "approval-requested" and str(r.seq) == adm.id)
        currency = self.dispatcher._bound(adm).budget.model.currency
        view = self.approvals.create(adm, payload, currency)
        self._announce("aisched.approval.requested", view)
        return Reply(status="approval-pending", admission=view.id, approval=view)

    def admit_approved(self, cred: Credential, meta: CallMeta, payload_digest: str) -> Admission:
        """The one execution an approval allows, after a fresh authority check; the caller must be the requester."""
        assert meta.admission is not None
        admission = self.approvals.admission(meta.admission)
        if not owns(cred, admission):
            raise Unauthorized("this approval belongs to another principal", 403)
        if admission.payload_digest != payload_digest:
            raise AdmissionDenied("approval", "the call's body or arguments differ from what was approved",
                                  "run the flow again to ask for this call")
        view, admission = self.approvals.consume(meta.admission)
        admission = admission.model_copy(update={"task_run_id": meta.task_run_id})
        snap = self.state.refresh()
        try:
            stages.authority(snap, stages.configuration(snap, cred), admission.facts, admission.chain[-1])
        except AdmissionDenied as exc:  # approved, but its authority ended while it waited: denied, and recorded
            self.dispatcher.settle(admission, None, {"outcome": "revoked-while-waiting", "approval": view.id})
            raise self.admitter.deny(exc.stage, exc.reason, exc.fix, {
                "task": admission.task_name, "flow": admission.flow_name, "tenant": admission.tenant,
                "request": admission.request.model_dump(mode="json"), "chain": admission.chain,
                "approval": view.id, "approved_by": view.approved_by}, admission.ids) from None
        if self.approvals._row(meta.admission).suspended:  # its holds were released while it waited: hold again
            admission = self.admitter.readmit(admission, "approved after suspension")
        self.ledger.record("admission", {"task": admission.task_name, "flow": admission.flow_name,
                                         "tenant": admission.tenant, "request": admission.request.model_dump(mode="json"),
                                         "approval": ", ".join(view.approved_by), "approval_id": view.id,
                                         "holds": [h.model_dump() for h in admission.holds], "chain": admission.chain,
                                         "grant": admission.chain[-1]}, **admission.ids)
        return admission

    def _announce(self, event: str, view: ApprovalView) -> None:
        """A Prefect event for every approval request, so automations can notify people (when Prefect is reachable)."""
        if not os.environ.get("PREFECT_API_URL"):
            return
        try:
            from prefect.events import emit_event

            emit_event(event=event, resource={"prefect.resource.id": f"aisched.approval.{view.id}",
                                              "prefect.resource.name": view.task_name, "aisched.principal": view.principal,
                                              "aisched.rule": str(view.rule)},
                       payload={"digest": view.digest, "est_cost": view.est_cost, "url": view.url})
        except Exception:
            logger.exception("could not emit %s", event)

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
            self._announce("aisched.approval.decided", view)
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
