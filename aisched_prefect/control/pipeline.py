"""Admission as one pass: the phases of phases.py, in order, over one snapshot of authority.

Kueue's scheduler runs numbered phases over a snapshot; so does `Pipeline.run`:

    0 configuration -> 1 feasibility -> 2 pricing -> 3 authority -> 4 approval policy -> 5 budget hold -> 6 record

Each phase is a function of the snapshot and the call under admission (`phases.Case`) that returns the case
with its decision, or a typed refusal (`AdmissionDenied`), which the pipeline records as one denial naming
the phase. Every call enters here once, whichever way it comes:

- a new call, from the top (a map's later element carries phases 1-4 as the element before it decided them:
  decisions.py);
- an approved call: its answer is taken (once: ApprovalBook.consume) and it re-enters the same pass, carrying
  what it was asked about (feasibility, price, the approval); configuration and authority are decided again
  over the snapshot of now (its holds are settled if they ended while it waited), its holds are kept, or taken
  again after a suspension, and its admission is recorded;
- a preempted run (dispatch): the same, its holds taken again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aisched_prefect.control.admission import Admission
from aisched_prefect.control.approvals import ApprovalBook
from aisched_prefect.control.credentials import Unauthorized, owns
from aisched_prefect.control.decisions import Decisions
from aisched_prefect.control.identity import Credential
from aisched_prefect.control.phases import Case, Phase, Phases
from aisched_prefect.control.state import AuthorityState
from aisched_prefect.errors import AdmissionDenied
from aisched_prefect.ledger import Ledger
from aisched_prefect.request import AIRequest
from aisched_prefect.wire import ApprovalView, CallMeta
from dask_gpu import WorkerInventory

Step = Callable[[Any, Case], Case]


class Pipeline:
    """Admits the calls of every caller of one control plane."""

    def __init__(self, ledger: Ledger, state: AuthorityState, inventories: Callable[[bool], dict[str, WorkerInventory]],
                 replica: str = "", approvals: ApprovalBook | None = None,
                 before_asking: Callable[[Credential], None] | None = None,
                 settle: Callable[[Admission, None, dict[str, Any]], None] | None = None) -> None:
        self.ledger, self.state, self.replica, self.approvals = ledger, state, replica, approvals
        self.settle = settle  # voids an approved call's holds when its authority ended while it waited
        phases = Phases(ledger, state, inventories, approvals, before_asking)
        self.phases: tuple[tuple[Phase, Step], ...] = (
            (Phase.CONFIGURATION, phases.configuration),
            (Phase.FEASIBILITY, phases.feasibility),
            (Phase.PRICING, phases.pricing),
            (Phase.AUTHORITY, phases.authority),
            (Phase.APPROVAL, phases.approval),
            (Phase.BUDGET_HOLD, phases.budget_hold),
            (Phase.RECORD, phases.record),
        )
        self.decisions = Decisions()

    def admit(self, cred: Credential, meta: CallMeta, request: AIRequest, payload_digest: str, args_digest: str,
              on_admitted: Callable[[Any, Admission], None] | None = None,
              function_digest: str = "") -> Admission | ApprovalView:
        """Admit one call: its admission, or the request for a person it waits on (its budget held, or, for the
        re-run of a suspended run, the request already on file); or raise AdmissionDenied (recorded).

        A call that names an approval (`meta.admission`) is the one execution that approval allows. `on_admitted
        (conn, admission)` runs in the transaction that takes a new admitted call's holds (not one that waits for a
        person): what it writes there is committed with them. `function_digest`: the digest of the function's
        pickled bytes this control plane computed from the call's body (the code identity the `new_flow_version`
        rule keys on; empty: unknown, so the code counts as new)."""
        if meta.admission is not None:
            case = self._approved(cred, meta, payload_digest)
        else:
            case = Case.new(cred, meta, request, payload_digest, args_digest, function_digest, on_admitted,
                            self.replica)
        return self.run(case)

    def readmit(self, admission: Admission, reason: str) -> Admission:
        """Admit a preempted run again: authority and budget as they are now, a new hold. A grant revoked or a
        budget spent while it ran ends it here, denied. An approval it had covers the call and is not asked again."""
        got = self.run(Case.carried(admission, None, {"requeued": reason}, requeued=reason))
        assert isinstance(got, Admission)
        return got

    def run(self, case: Case) -> Admission | ApprovalView:
        """One pass: every phase the case does not carry, in order, over one snapshot."""
        snap = self.state.refresh()
        for phase, step in self.phases:
            if phase in case.decided:
                continue
            try:
                case = step(snap, case)
            except AdmissionDenied as exc:
                raise self._refused(case, phase, exc) from None
            if case.waiting is not None:
                return case.waiting
            if phase is Phase.CONFIGURATION:
                case = self.decisions.reuse(snap, case)
            elif phase is Phase.APPROVAL:
                self.decisions.keep(snap, case)
        assert case.admission is not None
        return case.admission

    def _approved(self, cred: Credential, meta: CallMeta, payload_digest: str) -> Case:
        """The one execution an approval allows, taken once; the caller must be the requester, with the bytes that
        were approved. Refused here (the approval's own records say why): nothing more is recorded."""
        assert meta.admission is not None and self.approvals is not None
        prior = self.approvals.admission(meta.admission)
        if not owns(cred, prior):
            raise Unauthorized("this approval belongs to another principal", 403)
        if prior.payload_digest != payload_digest:
            raise AdmissionDenied("approval", "the call's body or arguments differ from what was approved",
                                  "run the flow again to ask for this call")
        answer, prior, suspended = self.approvals.consume(meta.admission)  # suspended: its holds were released
        prior = prior.model_copy(update={"task_run_id": meta.task_run_id})
        payload = {"chain": prior.chain, "approval": answer.id, "approved_by": answer.approved_by,
                   **({"requeued": "approved after suspension"} if suspended else {})}
        return Case.carried(prior, cred, payload, "approved after suspension" if suspended else None, answer)

    def _refused(self, case: Case, phase: Phase, exc: AdmissionDenied) -> AdmissionDenied:
        """A refusal, recorded once as a denial; an approved call refused before its hold gives its holds back."""
        if case.answer is not None and case.prior is not None and phase <= Phase.AUTHORITY and self.settle:
            self.settle(case.prior, None, {"outcome": "revoked-while-waiting", "approval": case.answer.id})
        self.ledger.record("denial", {**case.payload, "stage": exc.stage, "reason": exc.reason, "fix": exc.fix},
                           **case.ids)
        return AdmissionDenied(exc.stage, exc.reason, exc.fix)
