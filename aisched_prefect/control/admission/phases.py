"""The admission phases, in order: each a function of one snapshot and the call under admission.

A phase takes the snapshot of authority its pass runs over and the `Case` (the call, and what the phases
before it decided) and returns the case with its own decision added, or raises its typed refusal,
`AdmissionDenied` naming the phase, the reason and the fix. The checks themselves are stages.py's (pure);
a phase puts what its check found on the case, in the words the admission's record uses. The last two
write: the budget hold (every account or none, with the decision's record, in one transaction) and what
follows it (the request for a person filed, the code's version marked seen, an approved call's admission).
`admission/pipeline.py` runs them in order, once each, and records a refusal.

A case that carries a phase's decision from an earlier pass (an approved call, a preempted run, a map's
element decided with the one before it) is not asked that phase again: `Case.decided`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any

from aisched_prefect.approvals import approval_digest
from aisched_prefect.control.admission import capacity
from aisched_prefect.control.admission import stages
from aisched_prefect.control.admission.capacity import joined_only
from aisched_prefect.control.admission.record import Admission, mark_version_seen, version_scope
from aisched_prefect.control.approvals.requests import ApprovalBook, announce
from aisched_prefect.control.authority.identity import Credential
from aisched_prefect.control.admission.idle_price import IdlePrice, idle_price
from aisched_prefect.control.authority.state import AuthorityState, Snapshot
from aisched_prefect.errors import AdmissionDenied, InvalidLedgerInput
from aisched_prefect.evidence import EvidenceRecord
from aisched_prefect.ledger import BudgetExceeded, Hold, Ledger
from aisched_prefect.request import AIRequest
from aisched_prefect.wire import ApprovalView, CallMeta
from blocks import ApprovalOutcome, CostEstimate, Grant, RunFacts
from dask_gpu import WorkerInventory


AT_START = "its start"  # when a map's later shard holds its budget


class Phase(IntEnum):
    """The phases of one admission, in the order a pass runs them."""

    CONFIGURATION = 0  # the applied blocks the caller's credential names
    FEASIBILITY = 1  # some worker could ever hold the request
    PRICING = 2  # its estimated cost, and the facts the rules read
    AUTHORITY = 3  # the grant chain, root first, that covers it
    APPROVAL = 4  # what the approval policy says (or the answer a person gave)
    BUDGET_HOLD = 5  # the estimate held on every account, with the decision's record, in one transaction
    RECORD = 6  # what follows the hold: a request for a person filed, the code version seen, an approval's admission


@dataclass(frozen=True)
class Case:
    """One call under admission: who asks, what for, and what each phase decided so far."""

    cred: Credential | None  # None: a requeued run, whose credential is read from the snapshot
    request: AIRequest
    ids: dict[str, Any]  # flow_run_id, task_run_id, principal: every record of it names them
    task_name: str
    flow_name: str | None
    payload: dict[str, Any]  # what its record says (its denial's too), growing phase by phase
    grant: str | None = None  # the grant the call names (None: the first of its grants that covers it)
    meta: CallMeta | None = None  # a new call: what the flow sent
    digests: dict[str, str] = field(default_factory=dict)  # of the payload, the arguments, the function
    on_admitted: Callable[[Any, Admission], None] | None = None  # files the call with its holds
    decided: frozenset[Phase] = frozenset()
    prior: Admission | None = None  # an approved call's or a preempted run's admission: its earlier decisions
    answer: ApprovalView | None = None  # the approval an approved call consumed
    requeued: str | None = None  # why its holds are taken again (preempted, approved after a suspension)
    # what the phases decide
    bound: stages.Bound | None = None
    first_of_version: bool = False
    workers: list[str] = field(default_factory=list)
    types: list[str] = field(default_factory=list)
    estimate: CostEstimate | None = None
    idle: IdlePrice | None = None  # the idle time it may leave warm, cut to fit max_cost_per_run (control.idle_price)
    facts: RunFacts | None = None
    chain: list[Grant] = field(default_factory=list)
    priority: int = 0
    outcome: ApprovalOutcome | None = None
    approval_id: str | None = None  # a new request for a person (the policy asks)
    admission: Admission | None = None  # after the hold
    waiting: ApprovalView | None = None  # the call ends here, waiting for this request's answer
    defer_hold: bool = False  # a later shard of a map the queue starts: its budget is held at its start

    @property
    def asking(self) -> bool:
        return self.prior is None and self.outcome is not None and self.outcome.action == "ask"

    @classmethod
    def new(cls, cred: Credential, meta: CallMeta, request: AIRequest, payload_digest: str, args_digest: str,
            function_digest: str, on_admitted: Callable[[Any, Admission], None] | None, replica: str) -> Case:
        payload = {"task": meta.task_name, "flow": meta.flow_name, "tenant": cred.tenant,
                   "request": request.model_dump(mode="json"), "code_digest": meta.code_digest,
                   "function_digest": function_digest, "payload_digest": payload_digest, "credential": cred.id,
                   "replica": replica}
        return cls(cred=cred, request=request, task_name=meta.task_name, flow_name=meta.flow_name, payload=payload,
                   ids={"flow_run_id": meta.flow_run_id, "task_run_id": meta.task_run_id, "principal": cred.principal},
                   grant=meta.grant, meta=meta, on_admitted=on_admitted,
                   digests={"payload": payload_digest, "args": args_digest, "function": function_digest})

    @classmethod
    def carried(cls, prior: Admission, cred: Credential | None, payload: dict[str, Any], requeued: str | None,
                answer: ApprovalView | None = None) -> Case:
        """A call admitted before (approved, or preempted): what it was admitted for stands (feasibility, price, the
        approval); configuration and authority are decided again over the snapshot of now, its holds taken again
        when `requeued`."""
        base = {"task": prior.task_name, "flow": prior.flow_name, "tenant": prior.tenant,
                "request": prior.request.model_dump(mode="json")}
        return cls(cred=cred, request=prior.request, ids=prior.ids, task_name=prior.task_name,
                   flow_name=prior.flow_name, payload={**base, **payload}, grant=prior.chain[-1],
                   decided=frozenset({Phase.FEASIBILITY, Phase.PRICING, Phase.APPROVAL}), prior=prior,
                   answer=answer, requeued=requeued, facts=prior.facts)


class Phases:
    """The phases of one control plane, each `(snapshot, case) -> case`, and what they read or write besides the
    snapshot: the workers' inventories, the ledger, the approvals book."""

    def __init__(self, ledger: Ledger, state: AuthorityState, inventories: Callable[[bool], dict[str, WorkerInventory]],
                 approvals: ApprovalBook | None = None,
                 before_asking: Callable[[Credential], None] | None = None) -> None:
        self.ledger, self.state, self.inventories, self.approvals = ledger, state, inventories, approvals
        self.before_asking = before_asking  # may refuse a new request for a person (raises)
        self.versions_seen: set[tuple[str, str]] = set()
        self.max_keep_warm = _max_keep_warm()

    def configuration(self, snap: Snapshot, case: Case) -> Case:
        """The applied blocks the credential binds the call to; fail closed on a broken evidence log."""
        cred = case.cred
        if case.prior is None and self.state.broken is not None:  # authority read from a tampered log is none
            raise AdmissionDenied("configuration", f"the control plane's evidence log is broken ({self.state.broken});"
                                  " it admits nothing until it is restored", "an operator investigates the database "
                                  "(aisched evidence verify --checkpoint DIR) and restores it")
        if cred is None:  # a requeued run: its credential as the snapshot has it now
            assert case.prior is not None
            cred = snap.credentials.get(case.prior.credential)
            if cred is None or cred.revoked:
                raise AdmissionDenied("authority", f"the credential of {case.prior.principal!r} was revoked",
                                      "an operator issues a new one")
        bound = stages.configuration(snap, cred)
        if case.prior is not None:
            return replace(case, cred=cred, bound=bound)
        assert case.meta is not None
        return replace(case, bound=bound, first_of_version=self._first_of_version(bound, cred, case),
                       payload={**case.payload, "authority": bound.authority.ref, "budget": bound.budget.ref,
                                "policy": bound.policy.ref if bound.policy else None})

    def feasibility(self, snap: Snapshot, case: Case) -> Case:
        """Against inventories at most a few seconds old; an infeasible answer is checked again on fresh ones."""
        tenant = case.cred.tenant if case.cred else None
        try:
            workers, types = stages.feasibility(case.request, joined_only(self.inventories(False)), tenant)
        except AdmissionDenied:
            fresh = self.inventories(True)
            try:
                workers, types = stages.feasibility(case.request, joined_only(fresh), tenant)
            except AdmissionDenied as refused:  # a group of the scaler at 0 jobs may hold it: it waits for that
                workers, types = capacity.feasible(stages.feasibility, case.request, fresh, tenant, refused)
        return replace(case, workers=workers, types=types)

    def pricing(self, snap: Snapshot, case: Case) -> Case:
        assert case.bound is not None and case.cred is not None and case.meta is not None
        estimate = stages.pricing(case.bound.budget, case.request, case.types)
        request, function_digest = case.request, case.digests["function"]
        facts = RunFacts(
            principal=case.cred.principal, tenant=case.cred.tenant, flow=case.flow_name,
            flow_version=function_digest[:16] or None, first_of_version=case.first_of_version, kind=request.kind,
            model=request.model, gpus=request.gpus, gpu_types=tuple(case.types), est_seconds=request.est_seconds,
            est_tokens=request.est_tokens, est_cost=estimate.amount)
        return replace(case, estimate=estimate, facts=facts, payload={**case.payload, "estimate": estimate.model_dump()})

    def authority(self, snap: Snapshot, case: Case) -> Case:
        assert case.bound is not None and case.facts is not None
        chain = stages.authority(snap, case.bound, case.facts, case.grant)
        if case.prior is not None:  # admitted before: its chain must still hold; what it was admitted with stands
            return replace(case, chain=chain)
        priority = min([case.request.priority, *(g.max_priority for g in chain)])
        assert case.estimate is not None
        idle = idle_price(case.bound.budget.model, case.request, case.types, case.estimate.amount, chain,
                          self.max_keep_warm)
        return replace(case, chain=chain, priority=priority, idle=idle,
                       payload={**case.payload, **chained(chain, priority), "idle": idle.model_dump()})

    def approval(self, snap: Snapshot, case: Case) -> Case:
        """What the policy says: approve, deny (refused), or ask a person (a new request, or the answer already on
        file for a re-run of a suspended run, which ends the call here with nothing more held)."""
        assert case.bound is not None and case.facts is not None and case.meta is not None and case.cred
        outcome = stages.policy(case.bound, with_idle(case))  # the price a rule reads includes the idle time
        case = replace(case, outcome=outcome, payload={**case.payload, "approval_rule": outcome.rule if outcome else None})
        if not case.asking:
            return case
        assert outcome is not None and case.estimate is not None
        meta = case.meta
        if meta.approver == "policy":
            raise AdmissionDenied("approval", f"approval policy rule {outcome.rule!r} asks a person, and this flow run "
                                  "was started with approver='policy' (nobody is asked)",
                                  "run it with approver='pause' so a person can answer")
        payload = {**case.payload, "approval_digest": approval_digest(
            run_key=meta.run_key, task_name=meta.task_name, parameters=case.digests["args"],
            request=case.payload["request"], est_cost=case.estimate.amount,
            currency=case.bound.budget.model.currency, rule=outcome.rule),
            "approvals_required": outcome.approvals_required, "require_signature": outcome.require_signature,
            "timeout_seconds": outcome.timeout_seconds, "parameters": meta.parameters}
        found = self.approvals.find(meta.flow_run_id, payload["approval_digest"]) if self.approvals else None
        if found is not None:  # the re-run of a suspended run: its request holds its answer; nothing more is held
            assert self.approvals is not None
            return replace(case, payload=payload, waiting=self.approvals.view(found))
        if self.before_asking is not None:  # before anything is held: a caller with too many open is refused
            self.before_asking(case.cred)
        return replace(case, payload=payload, approval_id=uuid.uuid4().hex)

    def budget_hold(self, snap: Snapshot, case: Case) -> Case:
        """Every account that covers the run holds its estimate, or none does; the decision's record (admission,
        or approval requested) and the call's own row are written in the same transaction."""
        if case.prior is not None:
            return self._hold_again(case)
        assert case.bound is not None and case.estimate is not None and case.facts is not None
        shares = {g.id: g.budget_share for g in case.chain if g.budget_share < 1}
        usage = stages.expected_usage(case.request, case.estimate.amount)
        on_admitted = case.on_admitted
        file_with_holds = (None if case.asking or on_admitted is None else
                           lambda conn, held, record: on_admitted(conn, admitted(case, shares, held, record)))
        # A later shard of a map holds nothing while it waits in the queue: what a map holds is what runs at once.
        deferred = case.defer_hold and not case.asking
        try:
            held, record = self.ledger.reserve(
                [] if deferred else stages.lines(case.bound, case.facts, usage, shares, self.ledger.now()),
                kind="approval-requested" if case.asking else "admission",
                payload={**case.payload, "approval": "pending" if case.asking
                         else case.payload.get("approval", "not required"),
                         **({"hold": f"at {AT_START}"} if deferred else {})}, **case.ids,
                also=file_with_holds)
        except BudgetExceeded as exc:
            raise AdmissionDenied("budget", str(exc), f"an operator raises the limit of {exc.budget!r} in budget "
                                  f"{case.bound.budget.name!r}, or lower est_seconds/gpus/est_tokens") from None
        except InvalidLedgerInput as exc:  # the ledger cannot book it (e.g. an account name too long): nothing held
            raise AdmissionDenied("budget", exc.reason, exc.fix) from None
        return replace(case, admission=admitted(case, shares, held, record))  # the one filed with the call

    def _hold_again(self, case: Case) -> Case:
        """An approved call keeps the holds taken when it asked; one whose holds were released (suspended) or a
        preempted run holds again, under the authority of now."""
        prior = case.prior
        assert prior is not None and case.bound is not None
        if case.requeued is None:
            return replace(case, admission=prior)
        try:  # a preempted run's call is filed with its new admission, or a replica taking it over reuses settled holds
            again = self._hold_prior(case.bound, prior, "admission", {
                **case.payload, "chain": [g.id for g in case.chain], "grant": case.chain[-1].id,
                "approval": "requeued after preemption"}, case.on_admitted, new_id=True)
        except InvalidLedgerInput as exc:
            raise AdmissionDenied("budget", exc.reason, exc.fix) from None
        except BudgetExceeded as exc:
            raise AdmissionDenied("budget", f"{exc} (queued again after a preemption)",
                                  f"an operator raises the limit of {exc.budget!r}") from None
        return replace(case, admission=again)

    def _hold_prior(self, bound: stages.Bound, prior: Admission, kind: str, payload: dict[str, Any],
                    on_filed: Callable[[Any, Admission], None] | None, new_id: bool) -> Admission:
        """Hold the estimate of a run admitted before (preempted, or a map's shard as it starts) on the accounts
        `bound` names now; `on_filed(conn, admission)` files the held admission in the hold's transaction. Its id
        is the hold's record (`new_id`) or its admission's. Raises BudgetExceeded or InvalidLedgerInput."""
        usage = stages.expected_usage(prior.request, prior.reserved)
        lines = stages.lines(bound, prior.facts, usage, prior.shares, self.ledger.now())

        def held_as(held: list[Hold], record: EvidenceRecord) -> Admission:
            return prior.model_copy(update={**({"id": str(record.seq)} if new_id else {}), "holds": held,
                                            "hold_at_start": False})

        held, record = self.ledger.reserve(lines, kind=kind, payload=payload, **prior.ids, also=None if on_filed is None
                                           else lambda conn, held, record: on_filed(conn, held_as(held, record)))
        return held_as(held, record)

    def start_hold(self, snap: Snapshot, prior: Admission,
                   on_held: Callable[[Any, Admission], None] | None = None) -> Admission:
        """A map's later shard as the queue starts it: its estimate held on the accounts its configuration names
        now, in a `shard-hold` record naming its admission (whose id it keeps). Its chain is the watcher's to
        check (it stops a waiting run whose authority ended within a poll); its credential is checked here."""
        cred = snap.credentials.get(prior.credential)
        if cred is None or cred.revoked or cred.expired(time.time()):
            raise AdmissionDenied("authority", f"the credential of {prior.principal!r} was revoked or expired while "
                                  "the run waited in the queue", "an operator issues a new one")
        bound = stages.configuration(snap, cred)
        try:
            return self._hold_prior(bound, prior, "shard-hold", {
                "task": prior.task_name, "admission": prior.id, "grant": prior.chain[-1] if prior.chain else None},
                on_held, new_id=False)
        except InvalidLedgerInput as exc:
            raise AdmissionDenied("budget", exc.reason, exc.fix) from None
        except BudgetExceeded as exc:
            raise AdmissionDenied("budget", f"{exc} (as the queue started it)",
                                  f"an operator raises the limit of {exc.budget!r} in budget "
                                  f"{bound.budget.name!r}") from None

    def record(self, snap: Snapshot, case: Case) -> Case:
        """A new call that asks a person files its request (announced as a Prefect event); one admitted without
        asking marks its code's version seen; an approved call's admission names who approved it. A preempted
        run's admission is the record its hold wrote."""
        adm, answer = case.admission, case.answer
        assert adm is not None
        if answer is not None:  # its code was asked about and approved: seen from now on
            self.versions_seen.update(mark_version_seen(self.ledger, adm))
            self.ledger.record("admission", {"task": adm.task_name, "flow": adm.flow_name, "tenant": adm.tenant,
                                             "request": adm.request.model_dump(mode="json"),
                                             "approval": ", ".join(answer.approved_by), "approval_id": answer.id,
                                             "holds": [h.model_dump() for h in adm.holds], "chain": adm.chain,
                                             "grant": adm.chain[-1]}, **adm.ids)
        elif case.asking:
            assert self.approvals is not None and case.bound is not None
            view = self.approvals.create(adm, {**case.payload, "approval": "pending"},
                                         case.bound.budget.model.currency)
            announce("aisched.approval.requested", view)
            return replace(case, waiting=view)
        elif case.prior is None:  # code a person is asked about is seen once its approval is used (above)
            self.versions_seen.update(mark_version_seen(self.ledger, adm))
        return case

    def _first_of_version(self, bound: stages.Bound, cred: Credential, case: Case) -> bool:
        """No run of this flow with these function bytes was admitted under this authority and tenant yet; read only
        when a policy rule asks. A call without a flow name or a digest is new code: nothing it claims was seen."""
        if bound.policy is None or not bound.policy.model.watches_flow_versions:
            return False
        flow, function_digest = case.flow_name, case.digests["function"]
        if flow is None or not function_digest:
            return True
        key = (version_scope(bound.authority.name, cred.tenant, flow), function_digest)
        if key in self.versions_seen:
            return False
        if self.ledger.flow_version_seen(*key):
            self.versions_seen.add(key)
            return False
        return True


def _max_keep_warm() -> float:
    """The plane's AISCHED_MAX_KEEP_WARM_SECONDS (what a run may keep its body warm at most)."""
    from aisched_prefect.settings import Settings

    try:
        return Settings().max_keep_warm_seconds
    except Exception:  # a bad setting is reported where the plane reads its settings; price the most then
        return float("inf")


def with_idle(case: Case) -> RunFacts:
    """The run's facts with its price including the idle time it may leave (never past its grants' cap)."""
    assert case.facts is not None
    if case.idle is None or not case.idle.cost:
        return case.facts
    total = (case.facts.est_cost or 0.0) + case.idle.cost
    if case.idle.capped_by is not None:
        total = min(total, min(g.max_cost_per_run for g in case.chain))
    return case.facts.model_copy(update={"est_cost": total})


def chained(chain: list[Grant], priority: int) -> dict[str, Any]:
    """What an admission's record says of its chain and priority."""
    return {"grant": chain[-1].id, "chain": [g.id for g in chain],
            "grant_versions": {g.id: stages.version_of(g) for g in chain}, "priority": priority}


def admitted(case: Case, shares: dict[str, float], held: list[Hold], record: EvidenceRecord) -> Admission:
    """The admission a new call's hold makes (pure: the same one is filed with the call and returned)."""
    assert case.cred is not None and case.meta is not None and case.estimate is not None and case.facts is not None
    assert case.bound is not None
    cred, meta = case.cred, case.meta
    return Admission(
        id=str(record.seq), credential=cred.id, principal=cred.principal, tenant=cred.tenant,
        flow_run_id=meta.flow_run_id, task_run_id=meta.task_run_id, task_name=meta.task_name, flow_name=meta.flow_name,
        run_key=meta.run_key, request=case.request, workers=case.workers, holds=held, reserved=case.estimate.amount,
        priced_type=case.estimate.gpu_type_priced, chain=case.payload["chain"],
        expires_at=stages.earliest_expiry(case.chain), facts=case.facts, shares=shares, priority=case.priority,
        payload_digest=case.digests["payload"], code_digest=meta.code_digest, function_digest=case.digests["function"],
        versions=case.bound.versions, approval=case.approval_id, approval_digest=case.payload.get("approval_digest"),
        keep_warm_seconds=case.idle.seconds if case.idle is not None else None,
        idle_cost=case.idle.cost if case.idle is not None else 0.0, array=meta.array,
        hold_at_start=case.defer_hold and not case.asking)
