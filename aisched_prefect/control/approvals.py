"""Approvals on the control plane: one request, answers that prove who gave them, one execution per approval.

An answer counts only when the control plane can tell it came from a
registered approver other than the requester: an approver credential (the
approval page, `aisched approve` with a token) or a signature by a key in the
applied authority's `approver_keys` (`aisched approve --key`). An answer typed
into the Prefect form proves nothing (Prefect OSS has no identity; the flow
itself can resume its own run) and is recorded, not counted.

State lives in `aisched_approvals` (its transitions are conditional updates,
so two replicas or two answers cannot both win), and every transition leaves
its evidence record.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa

from aisched_prefect.approvals import ApprovalDecision, batch_digest, request_digest, signature_valid
from aisched_prefect.control import stages
from aisched_prefect.control.admission import Admission, mark_version_seen
from aisched_prefect.control.identity import Credential
from aisched_prefect.control.state import AuthorityState
from aisched_prefect.errors import AdmissionDenied, AISchedError
from aisched_prefect.ledger import Ledger
from aisched_prefect.wire import ApprovalView
from blocks import ChainBroken, Grant

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
)


links = sa.Table(
    "aisched_approval_links", metadata,
    sa.Column("id", sa.String(16), primary_key=True),
    sa.Column("approval_id", sa.String(32), nullable=False, index=True),
    sa.Column("approver", sa.String(200), nullable=False),
    sa.Column("secret_hash", sa.String(64), nullable=False),  # sha256 of the secret: the link itself is never stored
    sa.Column("expires_at", sa.Float, nullable=False),
    sa.Column("used_at", sa.Float),
)

SHORT_ID = 8  # `aisched approvals list` shows this many characters of an id; any unique prefix this long resolves


@dataclass(frozen=True)
class LinkHolder:
    """Whoever opened a one-time approval link: it proves the approver it was made for, for one request, once."""

    principal: str
    link_id: str
    approval_id: str
    used: bool


def _link_hash(secret: str) -> str:
    return hashlib.sha256(f"aisched-approval-link/1\n{secret}".encode()).hexdigest()


class ApprovalError(AISchedError):
    """An answer that cannot be taken: unknown approval, already decided, or not from an approver."""

    def __init__(self, message: str, status: int = 400) -> None:
        self.status = status
        super().__init__(message)


class ApprovalBook:
    """Every approval of one control plane (shared by its replicas through the database)."""

    def __init__(self, ledger: Ledger, state: AuthorityState, base_url: str = "") -> None:
        self.ledger, self.state, self.base_url = ledger, state, base_url
        metadata.create_all(ledger.engine, checkfirst=True)

    # -- asking ---------------------------------------------------------------------------
    def create(self, admission: Admission, payload: dict[str, Any], currency: str) -> ApprovalView:
        """File the request the admission record describes (its budget is already held)."""
        timeout = int(payload["timeout_seconds"])
        call_digest = payload["approval_digest"]
        call_index = self._completed_calls(admission.flow_run_id, call_digest)
        approval_id = admission.approval or admission.id
        view = ApprovalView(
            id=approval_id, status="pending", digest=request_digest(call_digest, approval_id),
            task_name=admission.task_name, task_run_id=admission.task_run_id, flow_run_id=admission.flow_run_id,
            principal=admission.principal, rule=payload.get("approval_rule"), est_cost=admission.reserved,
            currency=currency, request=admission.request.model_dump(mode="json"), chain=admission.chain,
            deadline=time.time() + timeout, timeout_seconds=timeout,
            approvals_required=payload.get("approvals_required", 1),
            require_signature=payload.get("require_signature", False), parameters=payload.get("parameters") or {})
        view = view.model_copy(update={"url": f"{self.base_url}/approve/{view.id}"})
        view = view.model_copy(update={"describe": describe(view, budget_left(admission.holds, currency))})
        with self.ledger.engine.begin() as conn:
            conn.execute(approvals.insert().values(
                id=view.id, digest=call_digest, call_index=call_index, flow_run_id=view.flow_run_id,
                task_run_id=view.task_run_id, principal=view.principal, status="pending", suspended=False,
                deadline=view.deadline, approved_by=[], decided_by=None, reason="", view=view.model_dump(mode="json"),
                admission=admission.model_dump(mode="json")))
        hook = self._hook(admission)
        if hook:
            threading.Thread(target=self._deliver, args=(view, hook), name="aisched-approval-hook", daemon=True).start()
        return view

    def _hook(self, admission: Admission) -> str | None:
        """The approval hook of the policy the run was admitted under (an operator's setting, never the flow's)."""
        ref = admission.versions.get("policy")
        if not ref:
            return None
        applied = self.state.snapshot.config("policy", ref.split(":", 1)[-1].rsplit("@", 1)[0])
        return getattr(applied.model, "approval_hook", None) if applied is not None else None

    def _deliver(self, view: ApprovalView, url: str) -> None:
        """Post the request with one link per approver to the policy's hook. The links go there only: the flow
        process (the requester) gets the view without them."""
        import httpx

        try:
            made = {who: self.make_link(view.id, who) for who in self.approvers(view.id)}
            httpx.post(url, json={"event": "aisched.approval.requested", **view.model_dump(mode="json"),
                                  "links": made}, timeout=10)
        except Exception:  # a chat hook that fails must not decide the run: the page's sign-in still works
            logger.exception("could not deliver approval %s to its hook %s", view.id, url)

    def find(self, flow_run_id: str, digest: str) -> str | None:
        """The request a re-run of a suspended flow run finds its answer in (approved, rejected, expired, or still
        open): the same call (digest, and as many identical calls completed before it), asked before the run was
        suspended, not used yet.

        Only suspended requests are found: in a flow run that was never suspended every call asks on its
        own, so two identical calls waiting at once are two requests, each allowing one execution."""
        call_index = self._completed_calls(flow_run_id, digest)
        with self.ledger.reader.connect() as conn:
            row = conn.execute(sa.select(approvals.c.id).where(
                (approvals.c.flow_run_id == flow_run_id) & (approvals.c.digest == digest)
                & (approvals.c.call_index == call_index) & (approvals.c.suspended == sa.true())
                & (approvals.c.status != "consumed")
            ).order_by(approvals.c.deadline.desc())).first()
        return row[0] if row else None

    def _completed_calls(self, flow_run_id: str, digest: str) -> int:
        return sum(1 for r in self.ledger.records(flow_run_id)
                   if r.kind == "settlement" and r.payload.get("approval_digest") == digest
                   and r.payload.get("outcome") == "completed")

    # -- one-time links -------------------------------------------------------------------
    def make_link(self, approval_id: str, approver: str) -> str:
        """A link that lets `approver` answer this one request once, until its deadline, with no secret to paste:
        `<base_url>/approve/<id>?link=<token>`. Only its hash is stored; whoever holds the link is that approver
        for this request (deliver it to them alone: the plane's approval hook, never the flow process)."""
        row = self._row(approval_id)
        if row.status != "pending" or time.time() >= row.deadline:
            raise ApprovalError(f"approval {approval_id} is {row.status}: no link is made for it", 409)
        if approver == row.principal:
            raise ApprovalError("the requester cannot approve its own run: no link is made for it", 403)
        link_id, secret = secrets.token_hex(8), secrets.token_urlsafe(24)
        with self.ledger.engine.begin() as conn:
            conn.execute(links.insert().values(id=link_id, approval_id=row.id, approver=approver,
                                               secret_hash=_link_hash(secret), expires_at=row.deadline, used_at=None))
        return f"{self.base_url}/approve/{row.id}?link=al_{link_id}_{secret}"

    def link_holder(self, approval_id: str, token: str) -> LinkHolder | None:
        """Who this link was made for, if it is a link for this request that has not expired; else None."""
        parts = token.split("_", 2)
        if len(parts) != 3 or parts[0] != "al" or len(parts[1]) != 16:
            return None
        with self.ledger.reader.connect() as conn:
            row = conn.execute(sa.select(links).where(links.c.id == parts[1])).first()
        if row is None or row.approval_id != approval_id or time.time() >= row.expires_at:
            return None
        if not hmac.compare_digest(row.secret_hash, _link_hash(parts[2])):
            return None
        return LinkHolder(principal=row.approver, link_id=row.id, approval_id=row.approval_id,
                          used=row.used_at is not None)

    def use_link(self, holder: LinkHolder) -> None:
        """Spend the link (once, on any replica): a second answer with it is refused."""
        with self.ledger.engine.begin() as conn:
            spent = conn.execute(links.update().where((links.c.id == holder.link_id) & links.c.used_at.is_(None))
                                 .values(used_at=time.time())).rowcount
        if spent != 1:
            raise ApprovalError("this link was used already: it answers once. Ask for a new one, or sign in", 409)

    def approvers(self, approval_id: str) -> list[str]:
        """Everyone who may approve this run now (a grant with can_approve covering it), the requester excluded:
        who the approval hook sends a link to."""
        adm = self.admission(approval_id)
        snap, authority = self._authority(adm)
        idx = snap.index(authority)
        names = {*idx.by_principal, *(p for (a, p) in snap.delegated_to if a in (authority.name, None))}
        groups = getattr(authority.model, "groups", {}) or {}
        names |= {m for members in groups.values() for m in members}
        return sorted(n for n in names if isinstance(n, str) and n != adm.principal and not n.startswith("group:")
                      and self._approver_chain(snap, authority, n, adm) is not None)

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
            snap, authority = self._authority(adm)
        except ApprovalError:
            return False
        if caller.authority is not None and caller.authority != authority.name:
            return False
        return self._approver_chain(snap, authority, caller.principal, adm) is not None

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
            raise ApprovalError(f"approval {approval_id} is already {view.status}", 409)
        adm = self.admission(approval_id)
        snap, authority = self._authority(adm)
        signed = view.digest if not batch or len(batch) == 1 else batch_digest([self.view(i).digest for i in batch])
        who, channel = self._identify(view, adm, authority, decision, caller, signed)
        chain = self._approver_chain(snap, authority, who, adm)
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
            """Count the vote against the row as it is now (two answers at once, on any replica, both count)."""
            cur = w.conn.execute(sa.select(approvals.c.status, approvals.c.approved_by)
                                 .where(approvals.c.id == approval_id).with_for_update()).first()
            if cur is None or cur.status != "pending":
                return "decided"
            earlier = list(cur.approved_by or [])
            if who in earlier:
                w.append("approval-vote", {**base, "counted": False, "approval": approval_id,
                                           "why": f"{who} already approved"}, adm.ids)
                return "repeat"
            # Earlier votes count while their approvers still hold the right to approve this run.
            chains = {who: base["approver_chain"]}
            for a in earlier:
                c = self._approver_chain(snap, authority, a, adm)
                if c is not None:
                    chains[a] = [g.id for g in c]
            gone = [a for a in earlier if a not in chains]
            lapsed = {"lapsed": gone} if gone else {}
            approved_by = [a for a in earlier if a in chains] + [who]
            ids = {"approval": approval_id, "approval_digest": row.digest, "request_digest": view.digest}
            if len(approved_by) >= view.approvals_required:
                w.conn.execute(approvals.update().where(approvals.c.id == approval_id).values(
                    status="approved", approved_by=approved_by, decided_by=who, reason=decision.reason))
                w.append("approval", {**base, **ids, "approved_by": approved_by, **lapsed,
                                      "approver_chains": {a: chains[a] for a in approved_by}}, adm.ids)
            else:
                w.conn.execute(approvals.update().where(approvals.c.id == approval_id).values(approved_by=approved_by))
                w.append("approval-vote", {**base, **ids, "counted": True, "approved_by": approved_by,
                                           "needed": view.approvals_required, **lapsed}, adm.ids)
            return "counted"

        if self.ledger._write(op) == "decided":
            raise ApprovalError(f"approval {approval_id} was decided meanwhile", 409)
        return self.view(approval_id)

    @staticmethod
    def _approver_chain(snap: Any, authority: Any, who: str, adm: Admission) -> list[Grant] | None:
        """The chain of a grant `who` holds with can_approve that covers this run, or None."""
        for grant in snap.grants_of(authority, who):
            if not grant.can_approve:
                continue
            try:
                chain = stages.chain_of(snap, authority, grant.id)
            except ChainBroken:
                continue
            if grant.refusal(adm.facts.model_copy(update={"principal": who})) is None:
                return chain
        return None

    def _authority(self, adm: Admission) -> tuple[Any, Any]:
        """The current snapshot and the applied authority the run was admitted under (its current version)."""
        snap = self.state.refresh()
        name = adm.versions.get("authority", "").split(":", 1)[-1].rsplit("@", 1)[0]
        authority = snap.config("authority", name)
        if authority is None:
            raise ApprovalError("the authority this run was admitted under is no longer applied", 409)
        return snap, authority

    def _identify(self, view: ApprovalView, adm: Admission, authority: Any, decision: ApprovalDecision,
                  caller: Credential | LinkHolder | None, signed: str) -> tuple[str, str]:
        """Who answered, proved: by an approver's credential, or by a signature over `signed` (this request's
        digest, or the batch digest of the requests answered together)."""
        if isinstance(caller, LinkHolder):
            if view.require_signature:
                raise ApprovalError(f"rule {view.rule!r} counts only signed approvals: "
                                    f"aisched approve {view.id} --key KEY", 403)
            if caller.approval_id != view.id:
                raise ApprovalError("this link was made for another request", 403)
            who, channel = caller.principal, "link"
        elif decision.signature:
            who = decision.approver.strip()
            key = authority.model.approver_keys.get(who)
            if key is None:
                raise ApprovalError(f"{who!r} signed, but has no key in the applied authority's approver_keys", 403)
            if not signature_valid(key, signed, decision):
                raise ApprovalError(f"the signature of {who!r} does not match this request (digest {signed[:12]}...): "
                                    "it was made for another request, or this one changed", 403)
            channel = "signed"
        else:
            if caller is None or caller.role not in ("approver", "operator"):
                raise ApprovalError("an answer needs an approver's credential or signature: a flow's credential "
                                    "cannot approve", 403)
            if caller.role == "approver" and caller.authority is not None and caller.authority != authority.name:
                raise ApprovalError(f"the credential of {caller.principal!r} was issued for authority "
                                    f"{caller.authority!r}; this run is under {authority.name!r}", 403)
            if view.require_signature:
                raise ApprovalError(f"rule {view.rule!r} counts only signed approvals: "
                                    f"aisched approve {view.id} --key KEY", 403)
            who, channel = caller.principal, "credential"
        if who == adm.principal:
            raise ApprovalError("the requester cannot approve its own run", 403)
        return who, channel

    def _decided_in_the_log(self, approval_id: str, view: ApprovalView) -> bool:
        """The decision that allows an execution is a signed record in the chain, not a row's status."""
        return _signed_approval(self.ledger.records_about(view.task_run_id), approval_id, self.state.trusted)

    def consume(self, approval_id: str) -> tuple[ApprovalView, Admission]:
        """The one execution an approval allows: approved -> consumed, once; anything else is refused."""
        view = self.view(approval_id)
        if view.status in ("rejected", "expired"):
            why = (view.reason if view.status == "expired"
                   else f"{view.decided_by} rejected the run" + (f": {view.reason}" if view.reason else ""))
            raise AdmissionDenied("approval", why, "run the flow again to ask again, or an operator changes the "
                                  "approval policy")
        if view.status == "consumed":
            raise AdmissionDenied("approval", f"approval {approval_id} already allowed one execution",
                                  "run the flow again to ask again")
        if view.status != "approved":
            raise ApprovalError(f"approval {approval_id} is {view.status}", 409)
        if not self._decided_in_the_log(approval_id, view):
            raise AdmissionDenied("approval", f"approval {approval_id} is marked approved, but the log holds no approval "
                                  "this control plane signed: its state was changed outside it",
                                  "an operator investigates the database; ask for the approval again")
        if not self._transition(approval_id, ("approved",), "consumed", "approval-consumed",
                                {"task": view.task_name, "approved_by": view.approved_by}):
            raise AdmissionDenied("approval", f"approval {approval_id} already allowed one execution",
                                  "run the flow again to ask again")
        admission = self.admission(approval_id)
        mark_version_seen(self.ledger, admission)  # its code was asked about and approved: seen from now on
        return view, admission


def _signed_approval(records: list[Any], approval_id: str, trusted: list[bytes]) -> bool:
    from aisched_prefect.evidence import record_signed

    return any(r.kind == "approval" and r.payload.get("approval") == approval_id and r.payload.get("approved")
               and (not trusted or record_signed(r, trusted)) for r in records)


def budget_left(holds: list[Any], currency: str) -> str:
    """What each budget the run holds against has left once this hold is counted."""
    return ", ".join(f"{h.budget}: {h.remaining_after:.2f} {currency if h.unit == 'money' else h.unit}" for h in holds)


def gpus_in_words(request: dict[str, Any]) -> str:
    """What a run asks for, as a person reads it: '2 H100 GPUs, each with at least 40 GB', 'half of one GPU'.

    >>> gpus_in_words({"gpus": 2, "gpu_type": "H100", "gpu_memory_gb": 40})
    '2 H100 GPUs, each with at least 40 GB'
    >>> gpus_in_words({"gpus": 0.5, "gpu_type": ["A10", "L4"]})
    'half of one A10 or L4 GPU'
    >>> gpus_in_words({"gpus": 1})
    '1 GPU of any type'
    """
    gpus = float(request.get("gpus") or 0)
    if not gpus:
        return "no GPU"
    types = request.get("gpu_type")
    names = " or ".join(types if isinstance(types, list) else [types]) if types else ""
    memory = request.get("gpu_memory_gb")
    if gpus < 1:
        share = {0.5: "half", 0.25: "a quarter"}.get(gpus, f"{gpus:g}")
        out = f"{share} of one {names + ' ' if names else ''}GPU" + (f" ({memory:g} GB reserved)" if memory else "")
    else:
        n = f"{gpus:g}"
        out = f"{n} {names + ' ' if names else ''}GPU{'s' if gpus != 1 else ''}{'' if names else ' of any type'}"
        if memory:
            out += f", {'each ' if gpus > 1 else ''}with at least {memory:g} GB"
    hosts = request.get("hosts")
    return out + (f", on {hosts} hosts" if hosts and hosts > 1 else "")


def duration_in_words(seconds: float) -> str:
    """'1 h 5 min', '4 min 10 s', '12 s'."""
    s = max(0, int(round(seconds)))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    if h:
        return f"{h} h {m} min" if m else f"{h} h"
    if m:
        return f"{m} min {sec} s" if sec else f"{m} min"
    return f"{sec} s"


def time_left(deadline: float, now: float | None = None) -> str:
    """The deadline as a time, and how long until it: 'until 14:32:05 UTC (in 4 min 10 s)'."""
    now = time.time() if now is None else now
    at = datetime.fromtimestamp(deadline, timezone.utc)
    when = at.strftime("%H:%M:%S UTC") if at.date() == datetime.fromtimestamp(now, timezone.utc).date() \
        else at.strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"until {when} (in {duration_in_words(deadline - now)})"


def describe(v: ApprovalView, left: str = "") -> str:
    """The markdown a person reads before deciding (Prefect's pause form shows it; the page shows the same)."""
    req = ", ".join(f"{k}={val}" for k, val in v.request.items() if val not in (None, 0, 0.0, False))
    quorum = f"- approvals needed: {v.approvals_required} different approvers\n" if v.approvals_required > 1 else ""
    signed = "- this rule counts only signed answers (`aisched approve --key`)\n" if v.require_signature else ""
    what = v.request.get("kind", "") + (f" of {v.request['model']}" if v.request.get("model") else "")
    runtime = f", about {duration_in_words(v.request['est_seconds'])}" if v.request.get("est_seconds") else ""
    return (f"**Approve AI task `{v.task_name}`?** ({what}: {gpus_in_words(v.request)}{runtime})\n\n"
            f"- principal: `{v.principal}`, grant chain `{' -> '.join(v.chain)}`\n"
            f"- request: {req}\n"
            f"- estimated cost: {v.est_cost:.4f} {v.currency}" + (f" (budget left after the hold: {left})" if left else "")
            + f"\n- asked by rule: `{v.rule}`\n{quorum}{signed}"
            f"- open {time_left(v.deadline)}: no answer by then denies the run\n"
            f"- approval digest: `{v.digest[:16]}`\n\n"
            f"**Answer on the control plane's page: [{v.url}]({v.url})** (open the one-time link you were sent, or "
            f"sign in there as an approver), or `aisched approve {v.id[:SHORT_ID]}`. This Prefect form has nothing to "
            "fill in. An answer typed into this Prefect form is not counted: Prefect cannot tell who typed it.")


def to_json(view: ApprovalView) -> str:
    return json.dumps(view.model_dump(mode="json"))
