"""Approvals on the control plane: one request, answers that prove who gave them, one execution per approval.

An answer counts only when the control plane can tell it came from a
registered approver other than the requester: an approver credential (the
approval page, `aisched approve` with a token) or a signature by a key in the
applied authority's `approver_keys` (`aisched approve --key`). An answer typed
into the Prefect form proves nothing (Prefect OSS has no identity; the flow
itself can resume its own run) and is recorded, not counted.

State lives in `aisched_approvals` (its transitions are conditional updates,
so two replicas or two answers cannot both win), and every transition leaves
its evidence record. What proves an answer is approval_proof.py, one-time links
and the approval hook approval_links.py, the request's words approval_words.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import sqlalchemy as sa

from aisched_prefect.approvals import ApprovalDecision, batch_digest, request_digest
from aisched_prefect.control.admission.record import Admission
from aisched_prefect.control.approvals.links import ApprovalLinks, hook_of
from aisched_prefect.control.approvals.proof import (
    ApprovalError,
    LinkHolder,
    approver_chain,
    approvers_of,
    authority_of,
    decided_in_the_log,
    identify,
)
from aisched_prefect.control.approvals.words import SHORT_ID, budget_left, closed, describe
from aisched_prefect.control.authority.identity import Credential
from aisched_prefect.control.authority.state import AuthorityState
from aisched_prefect.errors import AdmissionDenied
from aisched_prefect.ledger import Ledger
from aisched_prefect.wire import ApprovalView

logger = logging.getLogger("aisched_prefect.control")
metadata = sa.MetaData()
approvals = sa.Table(
    "aisched_approvals", metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("digest", sa.String(64), nullable=False, index=True),
    sa.Column("call_index", sa.Integer, nullable=False, default=0),
    sa.Column("flow_run_id", sa.String(64), nullable=False, index=True),
    sa.Column("task_run_id", sa.String(64), nullable=False),
    sa.Column("principal", sa.String(200), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),  # pending | approved | rejected | expired | consumed
    sa.Column("suspended", sa.Boolean, nullable=False, default=False),
    sa.Column("deadline", sa.Float, nullable=False),
    sa.Column("approved_by", sa.JSON, nullable=False),
    sa.Column("decided_by", sa.String(200)),
    sa.Column("reason", sa.Text, nullable=False, default=""),
    sa.Column("view", sa.JSON, nullable=False),
    sa.Column("admission", sa.JSON, nullable=False),
    sa.Column("seen", sa.Float),  # when the flow that asked last polled for it (approval_waiters.py)
)


def create_table(engine: sa.Engine) -> None:
    """The approvals table, and the columns a table of an older release lacks (two replicas may race to add one)."""
    metadata.create_all(engine, checkfirst=True)
    if "seen" not in {c["name"] for c in sa.inspect(engine).get_columns(approvals.name)}:
        try:
            with engine.begin() as conn:
                conn.exec_driver_sql(f"ALTER TABLE {approvals.name} ADD COLUMN seen FLOAT")
        except sa.exc.DBAPIError:
            if "seen" not in {c["name"] for c in sa.inspect(engine).get_columns(approvals.name)}:
                raise


def announce(event: str, view: ApprovalView) -> None:
    """A Prefect event for every approval request and answer, so automations can notify people (when Prefect is
    reachable)."""
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


class ApprovalBook:
    """Every approval of one control plane (shared by its replicas through the database)."""

    def __init__(self, ledger: Ledger, state: AuthorityState, base_url: str = "") -> None:
        self.ledger, self.state, self.base_url = ledger, state, base_url
        create_table(ledger.engine)
        self.links = ApprovalLinks(ledger, base_url)  # one-time links for approvers (approval_links.py)

    def make_link(self, approval_id: str, approver: str) -> str:
        """A one-time link for `approver` to answer this request (ApprovalLinks.make)."""
        return self.links.make(self._row(approval_id), approver)

    # -- asking ---------------------------------------------------------------------------
    def create(self, admission: Admission, payload: dict[str, Any], currency: str) -> ApprovalView:
        """File the request the admission record describes (its budget is already held)."""
        timeout = int(payload["timeout_seconds"])
        call_digest = payload["approval_digest"]
        call_index = _completed_calls(self.ledger, admission.flow_run_id, call_digest)
        approval_id = admission.approval or admission.id
        view = ApprovalView(
            id=approval_id, status="pending", digest=request_digest(call_digest, approval_id),
            task_name=admission.task_name, task_run_id=admission.task_run_id, flow_run_id=admission.flow_run_id,
            principal=admission.principal, rule=payload.get("approval_rule"),
            est_cost=admission.reserved + admission.idle_cost, idle_cost=admission.idle_cost,
            idle_seconds=admission.keep_warm_seconds or 0.0,
            currency=currency, request=admission.request.model_dump(mode="json"), chain=admission.chain,
            deadline=time.time() + timeout, timeout_seconds=timeout,
            approvals_required=payload.get("approvals_required", 1),
            require_signature=payload.get("require_signature", False), parameters=payload.get("parameters") or {},
            approvers=_who_may_approve(self.state, admission))
        view = view.model_copy(update={"url": f"{self.base_url}/approve/{view.id}"})
        view = view.model_copy(update={"describe": describe(view, budget_left(admission.holds, currency))})
        with self.ledger.engine.begin() as conn:
            conn.execute(approvals.insert().values(
                id=view.id, digest=call_digest, call_index=call_index, flow_run_id=view.flow_run_id,
                task_run_id=view.task_run_id, principal=view.principal, status="pending", suspended=False,
                deadline=view.deadline, seen=time.time(), approved_by=[], decided_by=None, reason="", view=view.model_dump(mode="json"),
                admission=admission.model_dump(mode="json")))
        hook = hook_of(self.state, admission)
        if hook:
            threading.Thread(target=self.links.deliver, args=(view, hook, self._row(view.id), self.approvers),
                             name="aisched-approval-hook", daemon=True).start()
        return view

    def find(self, flow_run_id: str, digest: str) -> str | None:
        """The request a re-run of a suspended flow run finds its answer in (approved, rejected, expired, or still
        open): the same call (digest, and as many identical calls completed before it), asked before the run was
        suspended, not used yet.

        Only suspended requests are found: in a flow run that was never suspended every call asks on its
        own, so two identical calls waiting at once are two requests, each allowing one execution."""
        call_index = _completed_calls(self.ledger, flow_run_id, digest)
        with self.ledger.reader.connect() as conn:
            row = conn.execute(sa.select(approvals.c.id).where(
                (approvals.c.flow_run_id == flow_run_id) & (approvals.c.digest == digest)
                & (approvals.c.call_index == call_index) & (approvals.c.suspended == sa.true())
                & (approvals.c.status != "consumed")
            ).order_by(approvals.c.deadline.desc())).first()
        return row[0] if row else None

    def approvers(self, approval_id: str) -> list[str]:
        """Everyone who may approve this run now, the requester excluded (approval_proof.approvers_of)."""
        return approvers_of(self.state, self.admission(approval_id))

    def may_see(self, approval_id: str, caller: Credential | LinkHolder | None) -> bool:
        """Whether this caller may be shown the request: an operator; an approver who may approve it (its authority,
        a grant with can_approve covering it); the flow that asked; the holder of a link made for it."""
        if caller is None:
            return False
        if isinstance(caller, LinkHolder):
            return caller.approval_id == self.resolve(approval_id)
        if caller.revoked:
            return False
        if caller.role == "operator":
            return True
        adm = self.admission(approval_id)
        if caller.role == "flow":
            return caller.principal == adm.principal and caller.authority == adm.authority
        try:
            snap, authority = authority_of(self.state, adm)
        except ApprovalError:
            return False
        if caller.authority is not None and caller.authority != authority.name:
            return False
        return approver_chain(snap, authority, caller.principal, adm) is not None

    def why_not(self, approval_id: str, caller: Credential, decision: ApprovalDecision) -> str:
        """Why this credential's answer cannot count, in words that tell nothing about the run."""
        if caller.role not in ("approver", "operator"):
            return f"a {caller.role} credential may not do this (needs approver or operator)"
        try:
            adm = self.admission(approval_id)
            if caller.authority is not None and caller.authority != adm.authority:
                return f"the credential of {caller.principal!r} was issued for another authority than this run's"
            self.check(approval_id, decision, caller)
        except ApprovalError as exc:
            return str(exc)
        return "this credential may not see this request"

    def resolve(self, approval_id: str) -> str:
        """The full id of a request named by its id or a unique prefix of at least SHORT_ID characters (the short ids
        `aisched approvals list` shows)."""
        if len(approval_id) >= 32 or len(approval_id) < SHORT_ID or not all(c in "0123456789abcdef" for c in approval_id):
            return approval_id
        with self.ledger.reader.connect() as conn:
            found = conn.execute(sa.select(approvals.c.id).where(approvals.c.id.like(f"{approval_id}%"))
                                 .limit(2)).scalars().all()
        if len(found) > 1:
            raise ApprovalError(f"approval id {approval_id!r} is ambiguous: give more of it "
                                "(aisched approvals list --json shows whole ids)", 400)
        return found[0] if found else approval_id

    # -- reading --------------------------------------------------------------------------
    def _row(self, approval_id: str) -> Any:
        with self.ledger.reader.connect() as conn:
            row = conn.execute(sa.select(approvals).where(approvals.c.id == approval_id)).first()
        if row is None:
            raise ApprovalError(f"no approval {approval_id!r}: see `aisched approvals list`", 404)
        return row

    def view(self, approval_id: str) -> ApprovalView:
        row = self._row(approval_id)
        if row.status == "pending" and time.time() >= row.deadline:
            self.expire(approval_id)
            row = self._row(approval_id)
        status = "suspended" if row.status == "pending" and row.suspended else row.status
        return ApprovalView.model_validate({**row.view, "status": status, "approved_by": list(row.approved_by or []),
                                            "decided_by": row.decided_by, "reason": row.reason or ""})

    def admission(self, approval_id: str) -> Admission:
        return Admission.model_validate(self._row(approval_id).admission)

    def pending(self) -> list[ApprovalView]:
        now = time.time()
        with self.ledger.reader.connect() as conn:
            ids = conn.execute(sa.select(approvals.c.id).where(approvals.c.status == "pending")
                               .order_by(approvals.c.deadline)).scalars().all()
        out = [self.view(i) for i in ids]
        return [v for v in out if v.status in ("pending", "suspended") and v.deadline > now]

    # -- transitions ----------------------------------------------------------------------
    def _transition(self, approval_id: str, frm: tuple[str, ...], to: str, kind: str, payload: dict[str, Any],
                    **values: Any) -> bool:
        """Move the approval from one of `frm` to `to` and record `kind`, in one transaction; False if it was not in `frm`."""
        row = self._row(approval_id)

        def op(w: Any) -> bool:
            res = w.conn.execute(approvals.update().where((approvals.c.id == approval_id) & approvals.c.status.in_(frm))
                                 .values(status=to, **values))
            if res.rowcount != 1:
                return False
            w.append(kind, {**payload, "approval": approval_id, "approval_digest": row.digest,
                            "request_digest": row.view["digest"]},
                     {"flow_run_id": row.flow_run_id, "task_run_id": row.task_run_id, "principal": row.principal})
            return True

        return self.ledger._write(op)

    def _void_holds(self, approval_id: str, outcome: str, kind: str = "settlement", **extra: Any) -> None:
        adm = self.admission(approval_id)
        self.ledger.settle([h.id for h in adm.holds], None, kind=kind,
                           payload={"task": adm.task_name, "flow": adm.flow_name, "tenant": adm.tenant,
                                    "request": adm.request.model_dump(mode="json"), "outcome": outcome,
                                    "approval": approval_id, **extra}, **adm.ids)

    def expire(self, approval_id: str) -> None:
        row = self._row(approval_id)
        reason = f"no decision within {int(row.view['timeout_seconds'])}s: silence denies"
        if self._transition(approval_id, ("pending",), "expired", "approval",
                            {"task": row.view["task_name"], "approved": False, "approver": "timeout",
                             "channel": "timeout", "reason": reason, "approval_rule": row.view.get("rule"),
                             "approved_by": list(row.approved_by or [])}, decided_by="timeout", reason=reason):
            if not row.suspended:
                self._void_holds(approval_id, "approval-expired")

    def tend(self) -> None:
        """Run periodically (the watcher): renew the holds of requests waiting for a person, whose leases would
        otherwise run out and be charged in full while nothing ran; end requests past their deadline (holds
        released), also when no flow process is left to ask."""
        now = time.time()
        with self.ledger.reader.connect() as conn:
            rows = conn.execute(sa.select(approvals.c.id, approvals.c.deadline, approvals.c.suspended,
                                          approvals.c.admission).where(approvals.c.status == "pending")).all()
        waiting: list[str] = []
        for row in rows:
            if now >= row.deadline:
                self.expire(row.id)
            elif not row.suspended:  # a suspended request holds nothing
                waiting.extend(h["id"] for h in (row.admission or {}).get("holds", []))
        self.ledger.renew(waiting)

    def suspend(self, approval_id: str) -> ApprovalView:
        """The flow run is being suspended (a deployment run): release its holds, keep the request open."""
        row = self._row(approval_id)
        if row.status == "pending" and not row.suspended:
            def op(w: Any) -> bool:
                res = w.conn.execute(approvals.update().where((approvals.c.id == approval_id)
                                                              & (approvals.c.suspended == sa.false()))
                                     .values(suspended=True))
                return res.rowcount == 1

            if self.ledger._write(op):  # one record: suspended, and its holds released (never charged)
                self._void_holds(approval_id, "suspended", kind="approval-suspended", expires_at=row.deadline,
                                 approval_digest=row.digest)
        return self.view(approval_id)

    def unverified(self, approval_id: str, said: dict[str, Any]) -> None:
        """An answer typed into the Prefect form: recorded, never counted."""
        row = self._row(approval_id)
        self.ledger.record("approval-unverified", {
            "approval": approval_id, "task": row.view["task_name"], "said": {k: str(v)[:200] for k, v in said.items()},
            "rule": "an answer counts only from an approver the control plane can identify (its page, or aisched approve)"},
            flow_run_id=row.flow_run_id, task_run_id=row.task_run_id, principal=row.principal)

    def open_batch(self, approval_id: str) -> list[ApprovalView]:
        """The requests one answer can cover with this one: the open requests of its flow run and principal
        (a `.map()` asks once), this one first."""
        view = self.view(approval_id)
        with self.ledger.reader.connect() as conn:
            ids = conn.execute(sa.select(approvals.c.id).where(
                (approvals.c.flow_run_id == view.flow_run_id) & (approvals.c.principal == view.principal)
                & (approvals.c.status == "pending") & (approvals.c.id != approval_id)
            ).order_by(approvals.c.deadline)).scalars().all()
        others = [self.view(i) for i in ids]
        return [view, *(v for v in others if v.status in ("pending", "suspended"))]

    def _prove(self, approval_id: str, decision: ApprovalDecision, caller: Credential | LinkHolder | None,
               batch: list[str] | None = None) -> tuple[ApprovalView, Admission, str, dict[str, Any], Any, Any]:
        """Who answers this request, proved, and their right to approve it; nothing is written.

        `batch`: the ids one answer covers together (a signature then signs their batch digest)."""
        view = self.view(approval_id)
        if view.status not in ("pending", "suspended"):
            raise ApprovalError(*closed(approval_id, view))
        adm = self.admission(approval_id)
        snap, authority = authority_of(self.state, adm)
        signed = view.digest if not batch or len(batch) == 1 else batch_digest([self.view(i).digest for i in batch])
        who, channel = identify(view, adm, authority, decision, caller, signed)
        chain = approver_chain(snap, authority, who, adm)
        if chain is None:
            raise ApprovalError(f"{who!r} holds no grant with the right to approve this run"
                                + (f" (request {approval_id} of the batch)" if batch and len(batch) > 1 else ""), 403)
        base = {"task": view.task_name, "approver": who, "approved": decision.approved, "reason": decision.reason,
                "channel": channel, "verified": True, "approval_rule": view.rule,
                "approver_chain": [g.id for g in chain], **({"signed_at": decision.signed_at} if decision.signature else {}),
                **({"batch": list(batch), "batch_digest": signed} if batch and len(batch) > 1 else {})}
        return view, adm, who, base, snap, authority

    def check(self, approval_id: str, decision: ApprovalDecision, caller: Credential | LinkHolder | None,
              batch: list[str] | None = None) -> None:
        """Raise ApprovalError unless this answer would count (every item of a batch is checked before any counts)."""
        self._prove(approval_id, decision, caller, batch)

    def answer(self, approval_id: str, decision: ApprovalDecision, caller: Credential | LinkHolder | None,
               batch: list[str] | None = None) -> ApprovalView:
        """Count one answer if it proves who gave it and that person may approve this run."""
        view, adm, who, base, snap, authority = self._prove(approval_id, decision, caller, batch)
        row = self._row(approval_id)
        if not decision.approved:
            if not self._transition(approval_id, ("pending",), "rejected", "approval", base,
                                    decided_by=who, reason=decision.reason):
                raise ApprovalError(f"approval {approval_id} was decided meanwhile", 409)
            if not row.suspended:
                self._void_holds(approval_id, "rejected")
            return self.view(approval_id)

        def op(w: Any) -> str:
            return _count_vote(w, view, adm, who, base, decision, row.digest, lambda a: approver_chain(snap, authority, a, adm))

        if self.ledger._write(op) == "decided":
            raise ApprovalError(f"approval {approval_id} was decided meanwhile", 409)
        return self.view(approval_id)

    def consume(self, approval_id: str) -> tuple[ApprovalView, Admission, bool]:
        """The one execution an approval allows: approved -> consumed, once; anything else is refused. With it, the
        admission it was asked for and whether it was suspended (its holds released while it waited)."""
        view = self.view(approval_id)
        why = _unusable(view)
        if why is None and not decided_in_the_log(self.ledger.records_about(view.task_run_id), approval_id,
                                                  self.state.trusted):
            why = (f"approval {approval_id} is marked approved, but the log holds no approval this control plane "
                   "signed: its state was changed outside it",
                   "an operator investigates the database; ask for the approval again")
        if why is None and not self._transition(approval_id, ("approved",), "consumed", "approval-consumed",
                                                {"task": view.task_name, "approved_by": view.approved_by}):
            why = (f"approval {approval_id} already allowed one execution", "run the flow again to ask again")
        row = self._row(approval_id)
        if why is not None and not why[1]:
            raise ApprovalError(why[0], 409)
        if why is not None:
            raise AdmissionDenied("approval", *why)
        return view, Admission.model_validate(row.admission), row.suspended


def _unusable(view: ApprovalView) -> tuple[str, str] | None:
    """Why a request allows no execution as it stands (the reason, and the fix: none while it is still open), or
    None: it is approved."""
    if view.status in ("rejected", "expired"):
        why = (view.reason if view.status == "expired"
               else f"{view.decided_by} rejected the run" + (f": {view.reason}" if view.reason else ""))
        return why, "run the flow again to ask again, or an operator changes the approval policy"
    if view.status == "consumed":
        return f"approval {view.id} already allowed one execution", "run the flow again to ask again"
    if view.status != "approved":
        return f"approval {view.id} is {view.status}", ""
    return None


def _count_vote(w: Any, view: ApprovalView, adm: Admission, who: str, base: dict[str, Any],
                decision: ApprovalDecision, approval_digest: str, chain_of: Any) -> str:
    """Count the vote against the row as it is now (two answers at once, on any replica, both count)."""
    cur = w.conn.execute(sa.select(approvals.c.status, approvals.c.approved_by)
                         .where(approvals.c.id == view.id).with_for_update()).first()
    if cur is None or cur.status != "pending":
        return "decided"
    earlier = list(cur.approved_by or [])
    if who in earlier:
        w.append("approval-vote", {**base, "counted": False, "approval": view.id,
                                   "why": f"{who} already approved"}, adm.ids)
        return "repeat"
    # Earlier votes count while their approvers still hold the right to approve this run.
    chains = {who: base["approver_chain"]}
    for a in earlier:
        c = chain_of(a)
        if c is not None:
            chains[a] = [g.id for g in c]
    gone = [a for a in earlier if a not in chains]
    lapsed = {"lapsed": gone} if gone else {}
    approved_by = [a for a in earlier if a in chains] + [who]
    ids = {"approval": view.id, "approval_digest": approval_digest, "request_digest": view.digest}
    if len(approved_by) >= view.approvals_required:
        w.conn.execute(approvals.update().where(approvals.c.id == view.id).values(
            status="approved", approved_by=approved_by, decided_by=who, reason=decision.reason))
        w.append("approval", {**base, **ids, "approved_by": approved_by, **lapsed,
                              "approver_chains": {a: chains[a] for a in approved_by}}, adm.ids)
    else:
        w.conn.execute(approvals.update().where(approvals.c.id == view.id).values(approved_by=approved_by))
        w.append("approval-vote", {**base, **ids, "counted": True, "approved_by": approved_by,
                                   "needed": view.approvals_required, **lapsed}, adm.ids)
    return "counted"


def _completed_calls(ledger: Any, flow_run_id: str, digest: str) -> int:
    """How many calls of this flow run one approval has already allowed (an approval allows one call)."""
    return sum(1 for r in ledger.records(flow_run_id)
               if r.kind == "settlement" and r.payload.get("approval_digest") == digest
               and r.payload.get("outcome") == "completed")


def _who_may_approve(state: Any, admission: Admission) -> list[str]:
    """Named on the request (console, page, form); a name that cannot be worked out never stops the asking."""
    try:
        return approvers_of(state, admission)
    except Exception:  # noqa: BLE001 - the request is filed either way; the page still checks each answer
        logger.warning("could not name the approvers of %s", admission.task_run_id, exc_info=True)
        return []
