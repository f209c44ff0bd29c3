"""One-time approval links: a URL that lets one approver answer one request once, until its deadline.

Only a hash of each link's secret is stored (`aisched_approval_links`); spending a link is a conditional update, so
it answers once on any replica. The approval hook delivers links to approvers, never to the flow process.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from aisched_prefect.control.admission.record import Admission
from aisched_prefect.control.approvals.proof import ApprovalError, LinkHolder
from aisched_prefect.control.authority.state import AuthorityState
from aisched_prefect.ledger import Ledger
from aisched_prefect.wire import ApprovalView

logger = logging.getLogger("aisched_prefect.control")

metadata = sa.MetaData()
links = sa.Table(
    "aisched_approval_links", metadata,
    sa.Column("id", sa.String(16), primary_key=True),
    sa.Column("approval_id", sa.String(32), nullable=False, index=True),
    sa.Column("approver", sa.String(200), nullable=False),
    sa.Column("secret_hash", sa.String(64), nullable=False),  # sha256 of the secret: the link itself is never stored
    sa.Column("expires_at", sa.Float, nullable=False),
    sa.Column("used_at", sa.Float),
)


def _link_hash(secret: str) -> str:
    return hashlib.sha256(f"aisched-approval-link/1\n{secret}".encode()).hexdigest()


def hook_of(state: AuthorityState, admission: Admission) -> str | None:
    """The approval hook of the policy the run was admitted under (an operator's setting, never the flow's)."""
    ref = admission.versions.get("policy")
    if not ref:
        return None
    applied = state.snapshot.config("policy", ref.split(":", 1)[-1].rsplit("@", 1)[0])
    return getattr(applied.model, "approval_hook", None) if applied is not None else None


class ApprovalLinks:
    """The links of one control plane's approvals (shared by its replicas through the database)."""

    def __init__(self, ledger: Ledger, base_url: str = "") -> None:
        self.ledger, self.base_url = ledger, base_url
        metadata.create_all(ledger.engine, checkfirst=True)

    def make(self, row: Any, approver: str) -> str:
        """A link that lets `approver` answer this one request once, until its deadline, with no secret to paste:
        `<base_url>/approve/<id>?link=<token>`. Only its hash is stored; whoever holds the link is that approver
        for this request (deliver it to them alone: the plane's approval hook, never the flow process)."""
        if row.status != "pending" or time.time() >= row.deadline:
            raise ApprovalError(f"approval {row.id} is {row.status}: no link is made for it", 409)
        if approver == row.principal:
            raise ApprovalError("the requester cannot approve its own run: no link is made for it", 403)
        link_id, secret = secrets.token_hex(8), secrets.token_urlsafe(24)
        with self.ledger.engine.begin() as conn:
            conn.execute(links.insert().values(id=link_id, approval_id=row.id, approver=approver,
                                               secret_hash=_link_hash(secret), expires_at=row.deadline, used_at=None))
        return f"{self.base_url}/approve/{row.id}?link=al_{link_id}_{secret}"

    def holder(self, approval_id: str, token: str) -> LinkHolder | None:
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

    def use(self, holder: LinkHolder) -> None:
        """Spend the link (once, on any replica): a second answer with it is refused."""
        with self.ledger.engine.begin() as conn:
            spent = conn.execute(links.update().where((links.c.id == holder.link_id) & links.c.used_at.is_(None))
                                 .values(used_at=time.time())).rowcount
        if spent != 1:
            raise ApprovalError("this link was used already: it answers once. Ask for a new one, or sign in", 409)

    def deliver(self, view: ApprovalView, url: str, row: Any, approvers: Callable[[str], list[str]]) -> None:
        """Post the request with one link per approver to the policy's hook. The links go there only: the flow
        process (the requester) gets the view without them."""
        import httpx

        try:
            made = {who: self.make(row, who) for who in approvers(view.id)}
            httpx.post(url, json={"event": "aisched.approval.requested", **view.model_dump(mode="json"),
                                  "links": made}, timeout=10)
        except Exception:  # a chat hook that fails must not decide the run: the page's sign-in still works
            logger.exception("could not deliver approval %s to its hook %s", view.id, url)
