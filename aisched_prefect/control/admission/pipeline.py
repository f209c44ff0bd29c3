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
- a preempted run (dispatch): the same, its holds taken again;
- a map's later shard the queue starts (dispatch): admitted with nothing held, then its hold as it starts
  (`hold_at_start`: the budget its configuration names now; its chain is the watcher's), its admission's id kept.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from aisched_prefect.control.admission.record import Admission
from aisched_prefect.control.approvals.proof import decided_in_the_log
from aisched_prefect.control.approvals.requests import ApprovalBook
from aisched_prefect.control.authority.credentials import Unauthorized, owns
from aisched_prefect.control.admission.decisions import Decisions
from aisched_prefect.control.authority.identity import Credential
from aisched_prefect.control.admission.phases import AT_START, Case, Phase, Phases
from aisched_prefect.control.authority.state import AuthorityState
from aisched_prefect.errors import AdmissionDenied
from aisched_prefect.ledger import Ledger
from aisched_prefect.request import AIRequest
from aisched_prefect.wire import ApprovalView, CallMeta
from dask_gpu import WorkerInventory

Step = Callable[[Any, Case], Case]


def _mark_map(case: Case) -> Case:
    """The first shard of an array that asks a person: its request is the whole map's, and says so to the approver
    (how many shards, about what they cost together, and the array it binds)."""
    assert case.meta is not None and case.meta.array is not None and case.estimate is not None
    array = case.meta.array
    size = array.size or 0
    text = (f"{size} shards, one approval for all (about {size * case.estimate.amount:.4f} together); "
            if size else "a map's shards, one approval for all; ") + f"map {array.id}"
    parameters = {**case.payload.get("parameters", {}), "map": text[:200]}
    return replace(case, payload={**case.payload, "parameters": parameters})


def holds_at_start(case: Case, defers: Callable[[AIRequest], bool] | None) -> bool:
    """Whether a call holds its budget when the queue starts it instead of as it is admitted (pure): a map's shard
    that reuses its array's decision, of a request the queue starts (`defers`). Slurm starts a job array's elements
    as resources allow: a map holds what runs at once, topped up as shards end, never more than its own estimate.
    Its first shard holds as it is admitted, so a map whose budget cannot cover one shard is refused at once."""
    meta = case.meta
    return (meta is not None and meta.array is not None and "decided_with" in case.payload and defers is not None
            and defers(case.request))


class Pipeline:
    """Admits the calls of every caller of one control plane."""

    def __init__(self, ledger: Ledger, state: AuthorityState, inventories: Callable[[bool], dict[str, WorkerInventory]],
                 replica: str = "", approvals: ApprovalBook | None = None,
                 before_asking: Callable[[Credential], None] | None = None,
                 settle: Callable[[Admission, None, dict[str, Any]], None] | None = None,
                 defers: Callable[[AIRequest], bool] | None = None) -> None:
        self.ledger, self.state, self.replica, self.approvals = ledger, state, replica, approvals
        self.settle = settle  # voids an approved call's holds when its authority ended while it waited
        self.defers = defers  # whether the queue starts runs of this request (their shards hold at their start)
        self._phases = phases = Phases(ledger, state, inventories, approvals, before_asking)
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
        map_approval = self._shared(cred, meta, request, function_digest) if meta.admission is not None else None
        if meta.admission is not None and map_approval is None:
            case = self._approved(cred, meta, payload_digest)
        else:
            case = Case.new(cred, meta, request, payload_digest, args_digest, function_digest, on_admitted,
                            self.replica)
        return self.run(case, map_approval)

    def _shared(self, cred: Credential, meta: CallMeta, request: AIRequest, function_digest: str) -> str | None:
        """The array's request for a person a shard waited on (it names one asked by another shard of its map), or
        None (the call's own). Only a shard of the same map may use it: the same principal, flow run, task, request
        and code, and the request says it was asked for this map."""
        assert meta.admission is not None
        if meta.array is None or self.approvals is None:
            return None
        view = self.approvals.view(meta.admission)
        if view.task_run_id == meta.task_run_id:
            return None
        prior = self.approvals.admission(meta.admission)
        if not (owns(cred, prior) and prior.flow_run_id == meta.flow_run_id and prior.task_name == meta.task_name
                and prior.request == request and prior.function_digest == function_digest
                and view.parameters.get("map", "").endswith(f"map {meta.array.id}")):
            raise AdmissionDenied("approval", f"approval request {meta.admission} was asked for another call, not "
                                  "for a shard of this map", "run the flow again to ask for this call")
        return meta.admission

    def readmit(self, admission: Admission, reason: str,
                on_admitted: Callable[[Any, Admission], None] | None = None) -> Admission:
        """Admit a preempted run again: authority and budget as they are now, a new hold. A grant revoked or a
        budget spent while it ran ends it here, denied. An approval it had covers the call and is not asked again.
        `on_admitted(conn, admission)` files the new admission with its call in the hold's transaction."""
        case = Case.carried(admission, None, {"requeued": reason}, requeued=reason)
        got = self.run(replace(case, on_admitted=on_admitted))
        assert isinstance(got, Admission)
        return got

    def hold_at_start(self, admission: Admission,
                      on_held: Callable[[Any, Admission], None] | None = None) -> Admission:
        """A map's later shard, as the queue starts it: its hold over the snapshot of now (a `shard-hold` record
        naming its admission, whose id it keeps). A budget spent or a credential revoked since it was admitted
        refuses it here, by name (a denial record). `on_held(conn, admission)` files the held admission with its
        call in the hold's transaction (a replica that takes the call over settles that hold)."""
        try:
            return self._phases.start_hold(self.state.snapshot, admission, on_held)
        except AdmissionDenied as exc:
            case = Case.carried(admission, None, {"admission": admission.id}, requeued=AT_START)
            raise self._refused(case, Phase.BUDGET_HOLD, exc) from None

    def run(self, case: Case, map_approval: str | None = None) -> Admission | ApprovalView:
        """One pass: every phase the case does not carry, in order, over one snapshot. The first shard of an array
        takes its decision while the array's other shards wait (`Decisions.deciding`); `map_approval`: the array's
        request for a person this shard waited on (checked by `admit`)."""
        snap = self.state.refresh()
        deciding: threading.Lock | None = None
        try:
            for phase, step in self.phases:
                if phase in case.decided:
                    continue
                try:
                    case = step(snap, case)
                    if phase is Phase.APPROVAL and case.asking and case.meta is not None and case.meta.array:
                        map_approval = map_approval or self.decisions.approval_of(snap, case)
                        case = self._map_asks(case, map_approval) if map_approval else _mark_map(case)
                except AdmissionDenied as exc:
                    raise self._refused(case, phase, exc) from None
                if case.waiting is not None:
                    if case.meta is not None and case.meta.array and case.approval_id == case.waiting.id:
                        self.decisions.keep(snap, case, approval=case.waiting.id)  # the array's one request
                    return case.waiting
                if phase is Phase.CONFIGURATION:
                    case = self.decisions.reuse(snap, case)
                    deciding = None if Phase.APPROVAL in case.decided else self.decisions.deciding(case)
                    if deciding is not None:  # an array's shard: the first decides, the others wait and reuse it
                        deciding.acquire()
                        case = self.decisions.reuse(snap, case)
                    if holds_at_start(case, self.defers):
                        case = replace(case, defer_hold=True)
                elif phase is Phase.BUDGET_HOLD and not case.asking:
                    # Kept once its decider holds: a later shard defers its own hold only behind one that held, so
                    # a map whose budget has no room for one shard is refused at admission, shard by shard.
                    self.decisions.keep(snap, case)
                    if deciding is not None:
                        deciding.release()
                        deciding = None
        finally:
            if deciding is not None:
                deciding.release()
        assert case.admission is not None
        return case.admission

    def _map_asks(self, case: Case, approval_id: str) -> Case:
        """A shard of an array whose policy asks a person: the array's one request decides it. Still open: the
        shard waits on it (nothing held, nothing recorded); approved: admitted as approved (its own hold and record,
        naming the request); refused, expired or withdrawn: denied with its reason."""
        assert self.approvals is not None
        view = self.approvals.view(approval_id)
        if view.status in ("pending", "suspended"):
            return replace(case, waiting=view)
        if view.status not in ("approved", "consumed"):
            why = (f"{view.decided_by} rejected the run" + (f": {view.reason}" if view.reason else "")
                   if view.status == "rejected" else view.reason or f"the map's approval request {approval_id} was "
                   f"{view.status}")
            raise AdmissionDenied("approval", f"{why} (the request asked for the whole map)",
                                  "run the flow again to ask again")
        if not decided_in_the_log(self.ledger.records_about(view.task_run_id), approval_id, self.state.trusted):
            raise AdmissionDenied("approval", f"the map's approval request {approval_id} is marked {view.status}, but "
                                  "the log holds no approval this control plane signed: its state was changed outside "
                                  "it", "an operator investigates the database; ask for the approval again")
        assert case.outcome is not None
        return replace(case, outcome=case.outcome.model_copy(update={"action": "approve"}), payload={
            **case.payload, "approval": f"approved with the map's request {approval_id} by "
                                        f"{', '.join(view.approved_by) or view.decided_by}",
            "map_approval": approval_id})

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
        reason, extra = exc.reason, {}
        array = case.meta.array if case.meta is not None else case.prior.array if case.prior is not None else None
        if array is not None:  # a shard of a map is refused by name: which shards ran and which did not is plain
            name = array.name or f"{case.task_name}-{array.index}"
            reason = f"shard {name!r} (#{array.index}{f' of {array.size}' if array.size else ''}) of the map: {reason}"
            extra = {"map": array.id, "shard": name, "shard_index": array.index}
        self.ledger.record("denial", {**case.payload, **extra, "stage": exc.stage, "reason": reason, "fix": exc.fix},
                           **case.ids)
        return AdmissionDenied(exc.stage, reason, exc.fix)
