"""Admission on the control plane: run the stages over one snapshot, record the outcome, reserve.

Kueue's scheduler runs its phases over a snapshot; so does `Admitter.admit`:
configuration -> feasibility -> pricing -> authority -> approval policy ->
budget hold (all accounts or none, with its evidence in one transaction) ->
a person, when the policy asks. Every outcome is one evidence record: an
admission, a denial (naming the stage, the reason and the fix), or an approval
request that holds the budget until a person answers.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict

from aisched_prefect.approvals import approval_digest
from aisched_prefect.control import stages
from aisched_prefect.control.identity import Credential
from aisched_prefect.control.state import AuthorityState
from aisched_prefect.errors import AdmissionDenied, InvalidLedgerInput
from aisched_prefect.evidence import EvidenceRecord
from aisched_prefect.ledger import BudgetExceeded, Hold, Ledger
from aisched_prefect.request import AIRequest
from aisched_prefect.wire import CallMeta
from blocks import RunFacts
from dask_gpu import WorkerInventory

logger = logging.getLogger("aisched_prefect.control")


class Admission(BaseModel):
    """An admitted run (or one waiting for a person): what dispatch and settlement need, from any replica."""

    model_config = ConfigDict(frozen=True)

    id: str
    credential: str
    principal: str
    tenant: str
    flow_run_id: str
    task_run_id: str
    task_name: str
    flow_name: str | None
    run_key: str
    request: AIRequest
    workers: list[str]
    holds: list[Hold]
    reserved: float
    priced_type: str | None
    chain: list[str]
    expires_at: float | None
    facts: RunFacts
    shares: dict[str, float] = {}
    priority: int = 0
    payload_digest: str
    code_digest: str  # what the flow says its function's code hashes to (the body checks it); never trusted here
    function_digest: str = ""  # sha256 of the function's pickled bytes as received, computed by the control plane
    versions: dict[str, str] = {}
    approval: str | None = None
    approval_digest: str | None = None

    @property
    def authority(self) -> str | None:
        """The name of the applied authority it was admitted under."""
        ref = self.versions.get("authority")
        return ref.split(":", 1)[1].rsplit("@", 1)[0] if ref else None

    @property
    def ids(self) -> dict[str, Any]:
        return {"flow_run_id": self.flow_run_id, "task_run_id": self.task_run_id, "principal": self.principal}


def version_scope(authority: str | None, tenant: str, flow: str) -> str:
    """The name code versions are remembered under: the flow's name within one authority and tenant (another
    tenant's approval of the same bytes is not this tenant's), at most 200 characters."""
    scope = hashlib.sha256(f"{authority}\n{tenant}\n{flow}".encode()).hexdigest()[:16]
    return f"{flow[:150]}#{scope}"


def mark_version_seen(ledger: Ledger, admission: Admission) -> list[tuple[str, str]]:
    """Remember that this admission's code ran (admitted without asking, or its approval used): the
    `new_flow_version` rule does not ask again for the same bytes of the same flow. Never for a call without a
    flow name or a digest. A failure is logged, not raised (its holds are taken; unmarked, it asks again)."""
    if not admission.facts.first_of_version or not admission.flow_name or not admission.function_digest:
        return []
    key = (version_scope(admission.authority, admission.tenant, admission.flow_name), admission.function_digest)
    try:
        ledger.mark_flow_version(*key)
    except Exception:
        logger.exception("could not mark flow %s version %s as seen", admission.flow_name, admission.function_digest)
        return []
    return [key]


DECISION_SECONDS = 2.0  # how long a map's elements share one decision (feasibility reads inventories this fresh)
MAX_DECISIONS = 4096


class Decision(BaseModel):
    """Stages 0-4's answer for one request: what every element of a map with that request shares."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    bound: Any
    workers: list[str]
    estimate: Any
    facts: RunFacts
    chain: list[Any]
    priority: int
    outcome: Any = None
    chain_payload: dict[str, Any] = {}  # what the admission's record says of the chain and priority
    shared_from: str | None = None  # the task run whose admission took this decision (set on reuse)


class ApprovalNeeded(Exception):
    """The policy asks a person: the budget is held (or, `existing`: the call's request is already on file and
    nothing more is held), the caller waits for the answer."""

    def __init__(self, admission: Admission, approval_id: str, existing: bool = False) -> None:
        self.admission, self.approval_id, self.existing = admission, approval_id, existing
        super().__init__(f"run {admission.task_run_id} waits for a person's approval ({approval_id})")


class Admitter:
    """Runs admission for every caller of one control plane."""

    def __init__(self, ledger: Ledger, state: AuthorityState, inventories: Callable[[bool], dict[str, WorkerInventory]],
                 replica: str = "", existing_approval: Callable[[str, str], str | None] | None = None) -> None:
        self.ledger, self.state, self.inventories, self.replica = ledger, state, inventories, replica
        self.existing_approval = existing_approval  # (flow run, digest) -> a request on file for this call
        self.before_asking: Callable[[Credential], None] | None = None  # may refuse a new request (raises)
        self._versions_seen: set[tuple[str, str]] = set()
        self._decisions: dict[tuple[Any, ...], tuple[Any, float, Decision]] = {}  # one decision per map (_decide)
        self._decisions_lock = threading.Lock()

    def deny(self, stage: str, reason: str, fix: str, payload: dict[str, Any], ids: dict[str, Any]) -> AdmissionDenied:
        self.ledger.record("denial", {**payload, "stage": stage, "reason": reason, "fix": fix}, **ids)
        return AdmissionDenied(stage, reason, fix)

    def admit(self, cred: Credential, meta: CallMeta, request: AIRequest, payload_digest: str, args_digest: str,
              approver: str = "pause", on_admitted: Callable[[Any, Admission], None] | None = None,
              function_digest: str = "") -> Admission:
        """Admit one call, or raise AdmissionDenied (recorded) or ApprovalNeeded (budget held, request recorded).

        `on_admitted(conn, admission)` runs in the transaction that takes an admitted call's holds (not a call
        that waits for a person): what it writes there is committed with them. `function_digest`: the digest of
        the function's pickled bytes this control plane computed from the call's body (the code identity the
        `new_flow_version` rule keys on; empty: unknown, so the code counts as new)."""
        snap = self.state.refresh()
        ids = {"flow_run_id": meta.flow_run_id, "task_run_id": meta.task_run_id, "principal": cred.principal}
        if self.state.broken is not None:  # fail closed: authority read from a log that was tampered with is no authority
            raise self.deny("configuration", f"the control plane's evidence log is broken ({self.state.broken}); it "
                            "admits nothing until it is restored", "an operator investigates the database (aisched "
                            "evidence verify --checkpoint DIR) and restores it", {"task": meta.task_name}, ids)
        payload: dict[str, Any] = {"task": meta.task_name, "flow": meta.flow_name, "tenant": cred.tenant,
                                   "request": request.model_dump(mode="json"), "code_digest": meta.code_digest,
                                   "function_digest": function_digest, "payload_digest": payload_digest, "credential": cred.id, "replica": self.replica}
        try:
            d = self._decide(snap, cred, meta, request, function_digest, payload)
        except AdmissionDenied as exc:
            raise self.deny(exc.stage, exc.reason, exc.fix, payload, ids) from None
        bound, workers, estimate, facts, chain, priority, outcome = (
            d.bound, d.workers, d.estimate, d.facts, d.chain, d.priority, d.outcome)
        if d.shared_from is not None:  # an element of a map decided with the element before it (same request)
            payload["decided_with"] = d.shared_from
        payload["approval_rule"] = outcome.rule if outcome else None
        asking = outcome is not None and outcome.action == "ask"
        if asking and approver == "policy":
            raise self.deny("approval", f"approval policy rule {outcome.rule!r} asks a person, and this flow run was "
                            "started with approver='policy' (nobody is asked)",
                            "run it with approver='pause' so a person can answer", payload, ids)
        shares = {g.id: g.budget_share for g in chain if g.budget_share < 1}
        usage = stages.expected_usage(request, estimate.amount)
        if asking:
            assert outcome is not None
            payload.update(approval_digest=approval_digest(
                run_key=meta.run_key, task_name=meta.task_name, parameters=args_digest, request=payload["request"],
                est_cost=estimate.amount, currency=bound.budget.model.currency, rule=outcome.rule),
                approvals_required=outcome.approvals_required, require_signature=outcome.require_signature,
                timeout_seconds=outcome.timeout_seconds, parameters=meta.parameters)
            found = self.existing_approval(meta.flow_run_id, payload["approval_digest"]) if self.existing_approval else None
            if found is not None:  # the re-run of a suspended run: its request holds its answer; nothing more is held
                raise ApprovalNeeded(Admission(
                    id=found, credential=cred.id, principal=cred.principal, tenant=cred.tenant,
                    flow_run_id=meta.flow_run_id, task_run_id=meta.task_run_id, task_name=meta.task_name,
                    flow_name=meta.flow_name, run_key=meta.run_key, request=request, workers=workers, holds=[],
                    reserved=estimate.amount, priced_type=estimate.gpu_type_priced, chain=payload["chain"],
                    expires_at=stages.earliest_expiry(chain), facts=facts, shares=shares, priority=priority,
                    payload_digest=payload_digest, code_digest=meta.code_digest, function_digest=function_digest,
                    versions=bound.versions,
                    approval=found, approval_digest=payload["approval_digest"]), found, existing=True)
            if self.before_asking is not None:  # before anything is held: a caller with too many open is refused
                self.before_asking(cred)
        approval_id = uuid.uuid4().hex if asking else None

        def build(held: list[Hold], record: EvidenceRecord) -> Admission:
            return Admission(
                id=str(record.seq), credential=cred.id, principal=cred.principal, tenant=cred.tenant,
                flow_run_id=meta.flow_run_id, task_run_id=meta.task_run_id, task_name=meta.task_name,
                flow_name=meta.flow_name, run_key=meta.run_key, request=request, workers=workers, holds=held,
                reserved=estimate.amount, priced_type=estimate.gpu_type_priced, chain=payload["chain"],
                expires_at=stages.earliest_expiry(chain), facts=facts, shares=shares, priority=priority,
                payload_digest=payload_digest, code_digest=meta.code_digest, function_digest=function_digest,
                    versions=bound.versions,
                approval=approval_id, approval_digest=payload.get("approval_digest"))

        file_with_holds = (None if asking or on_admitted is None else
                           lambda conn, held, record: on_admitted(conn, build(held, record)))
        try:
            held, record = self.ledger.reserve(
                stages.lines(bound, facts, usage, shares, self.ledger.now()),
                kind="approval-requested" if asking else "admission",
                payload={**payload, "approval": "pending" if asking else "not required"}, **ids,
                also=file_with_holds)
        except BudgetExceeded as exc:
            raise self.deny("budget", str(exc), f"an operator raises the limit of {exc.budget!r} in budget "
                            f"{bound.budget.name!r}, or lower est_seconds/gpus/est_tokens", payload, ids) from None
        except InvalidLedgerInput as exc:  # the ledger cannot book it (e.g. an account name too long): nothing held
            raise self.deny("budget", exc.reason, exc.fix, payload, ids) from None
        admission = build(held, record)  # the same admission the call was filed with (build is pure)
        if not asking:  # code a person is asked about is seen once its approval is used (ApprovalBook.consume)
            self._versions_seen.update(mark_version_seen(self.ledger, admission))
        if asking:
            raise ApprovalNeeded(admission, admission.approval or "")
        return admission

    def _decide(self, snap: Any, cred: Credential, meta: CallMeta, request: AIRequest, function_digest: str,
                payload: dict[str, Any]) -> Decision:
        """Stages 0-4 (configuration, feasibility, pricing, authority, approval policy), once per map; what each
        stage found goes into `payload` (the admission's or the denial's record) as it is found.

        The elements of a `.map()` are one request in all but their arguments: the same credential, task, request,
        grant and code, over the same snapshot of authority. Their decision is taken once and reused (a job
        array, as Slurm admits one) while the snapshot is the same object (any authority record, a revocation
        or an apply, makes a new one), for at most DECISION_SECONDS (the inventories feasibility reads are that
        fresh), never past the chain's earliest expiry nor a whole UTC hour (where a rule's hours_utc turns).
        Budget is not part of it: each element holds its own (ledger.reserve), and has its own admission record.
        A decision that asks a person is never reused: each call is asked on its own."""
        bound = stages.configuration(snap, cred)
        payload.update(authority=bound.authority.ref, budget=bound.budget.ref,
                       policy=bound.policy.ref if bound.policy else None)
        first = self._first_of_version(bound, cred, meta.flow_name, function_digest)
        key = (cred.id, meta.task_name, meta.flow_name, meta.grant, meta.approver, function_digest, first,
               request.model_dump_json())
        now = time.time()
        with self._decisions_lock:
            hit = self._decisions.get(key)
        if hit is not None and hit[0] is snap and now < hit[1]:
            d = hit[2]
            payload.update(estimate=d.estimate.model_dump(), **d.chain_payload)
            return d
        workers, types = self._feasible(request, cred.tenant)
        estimate = stages.pricing(bound.budget, request, types)
        payload["estimate"] = estimate.model_dump()
        facts = RunFacts(
            principal=cred.principal, tenant=cred.tenant, flow=meta.flow_name, flow_version=function_digest[:16] or None,
            first_of_version=first, kind=request.kind, model=request.model, gpus=request.gpus, gpu_types=tuple(types),
            est_seconds=request.est_seconds, est_tokens=request.est_tokens, est_cost=estimate.amount)
        chain = stages.authority(snap, bound, facts, meta.grant)
        priority = min([request.priority, *(g.max_priority for g in chain)])
        chained = {"grant": chain[-1].id, "chain": [g.id for g in chain],
                   "grant_versions": {g.id: stages.version_of(g) for g in chain}, "priority": priority}
        payload.update(chained)
        outcome = stages.policy(bound, facts)
        decision = Decision(bound=bound, workers=workers, estimate=estimate, facts=facts, chain=chain,
                            priority=priority, outcome=outcome, chain_payload=chained)
        if outcome is None or outcome.action != "ask":
            expiry = stages.earliest_expiry(chain)
            next_hour = (now // 3600 + 1) * 3600  # a rule's hours_utc turns at a whole hour
            until = min(now + DECISION_SECONDS, next_hour, expiry if expiry is not None else next_hour)
            with self._decisions_lock:
                if len(self._decisions) >= MAX_DECISIONS:
                    self._decisions.clear()
                self._decisions[key] = (snap, until, decision.model_copy(update={"shared_from": meta.task_run_id}))
        return decision

    def _feasible(self, request: AIRequest, tenant: str | None) -> tuple[list[str], list[str]]:
        """Feasibility against inventories at most a few seconds old; an infeasible answer is re-checked fresh."""
        try:
            return stages.feasibility(request, self.inventories(False), tenant)
        except AdmissionDenied:
            return stages.feasibility(request, self.inventories(True), tenant)

    def _first_of_version(self, bound: stages.Bound, cred: Credential, flow: str | None, function_digest: str) -> bool:
        """No run of this flow with these function bytes was admitted under this authority and tenant yet; read only
        when a policy rule asks. A call without a flow name or a digest is new code: nothing it claims was seen."""
        if bound.policy is None or not bound.policy.model.watches_flow_versions:
            return False
        if flow is None or not function_digest:
            return True
        key = (version_scope(bound.authority.name, cred.tenant, flow), function_digest)
        if key in self._versions_seen:
            return False
        if self.ledger.flow_version_seen(*key):
            self._versions_seen.add(key)
            return False
        return True

    def readmit(self, admission: Admission, reason: str) -> Admission:
        """Admit a preempted run again: authority and budget as they are now, a new hold.

        A grant revoked or a budget spent while it ran ends it here, denied. An
        approval it had covers the call and is not asked again.
        """
        snap = self.state.refresh()
        payload = {"task": admission.task_name, "flow": admission.flow_name, "tenant": admission.tenant,
                   "request": admission.request.model_dump(mode="json"), "requeued": reason}
        cred = snap.credentials.get(admission.credential)
        try:
            if cred is None or cred.revoked:
                raise AdmissionDenied("authority", f"the credential of {admission.principal!r} was revoked",
                                      "an operator issues a new one")
            bound = stages.configuration(snap, cred)
            chain = stages.authority(snap, bound, admission.facts, admission.chain[-1])
        except AdmissionDenied as exc:
            raise self.deny(exc.stage, exc.reason, exc.fix, payload, admission.ids) from None
        usage = stages.expected_usage(admission.request, admission.reserved)
        try:
            lines = stages.lines(bound, admission.facts, usage, admission.shares, self.ledger.now())
            held, record = self.ledger.reserve(lines, kind="admission", payload={
                **payload, "chain": [g.id for g in chain], "grant": chain[-1].id,
                "approval": "requeued after preemption"}, **admission.ids)
        except InvalidLedgerInput as exc:
            raise self.deny("budget", exc.reason, exc.fix, payload, admission.ids) from None
        except BudgetExceeded as exc:
            raise self.deny("budget", f"{exc} (queued again after a preemption)",
                            f"an operator raises the limit of {exc.budget!r}", payload, admission.ids) from None
        return admission.model_copy(update={"id": str(record.seq), "holds": held})
