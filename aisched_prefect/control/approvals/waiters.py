"""Who still waits for a person's answer: a request whose flow stopped waiting is withdrawn, its budget released.

Why: a request nobody waits for would hold its budget until its deadline (hours), and an approval given to it
would answer "approved" though nothing will run. A flow that is stopped (Ctrl-C, SIGTERM, Prefect cancellation)
withdraws its requests itself (`withdraw`); a flow process that died stops polling, and its requests are withdrawn
once none was polled for the session lease (`sweep`, the watcher's chore). A late answer is then told the run is
gone (approval_words.closed). A suspended request (a deployment run, by design without a process) holds nothing
and is never swept.

"Seen" is written to the approvals table, not kept in memory, so a flow whose polls reach another replica, or a
plane that restarted, is not taken for gone.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import sqlalchemy as sa

from aisched_prefect.control.approvals.requests import ApprovalBook, approvals
from aisched_prefect.wire import ApprovalView

logger = logging.getLogger("aisched_prefect.control")


class Waiters:
    """The liveness of the flows that asked: marked by their polls, ended by their stop or their silence."""

    def __init__(self, book: ApprovalBook, lease_seconds: float, clock: Callable[[], float] = time.time) -> None:
        """`clock`: wall-clock seconds (a test's own, so the lease is judged without waiting on a loaded host)."""
        self.book, self.lease_seconds, self.clock = book, lease_seconds, clock

    def seen(self, approval_id: str) -> None:
        """The flow that asked polled for this request: it, and every open request of its flow run (one poll at a
        time serves a whole `.map()`'s requests), still have someone waiting. At most one write a second."""
        row = self.book._row(approval_id)
        now = self.clock()
        where = ((approvals.c.flow_run_id == row.flow_run_id) & (approvals.c.principal == row.principal)
                 & (approvals.c.status == "pending") & (approvals.c.suspended == sa.false())
                 & ((approvals.c.seen == sa.null()) | (approvals.c.seen < now - 1.0)))

        def op(w: Any) -> int:
            return w.conn.execute(approvals.update().where(where).values(seen=now)).rowcount

        self.book.ledger._write(op)

    def withdraw(self, approval_id: str, why: str) -> ApprovalView:
        """The flow stopped waiting: end the request (if still open and not suspended) and release its holds."""
        row = self.book._row(approval_id)
        if row.status == "pending" and not row.suspended:
            reason = f"withdrawn: {why}"
            if self.book._transition(approval_id, ("pending",), "withdrawn", "approval-withdrawn",
                                     {"task": row.view["task_name"], "reason": reason}, reason=reason):
                self.book._void_holds(approval_id, "approval-withdrawn")
        return self.book.view(approval_id)

    def sweep(self) -> list[str]:
        """Withdraw the open requests no flow has polled for the lease (its process died); their ids."""
        cutoff = self.clock() - self.lease_seconds
        with self.book.ledger.reader.connect() as conn:
            ids = conn.execute(sa.select(approvals.c.id).where(
                (approvals.c.status == "pending") & (approvals.c.suspended == sa.false())
                & (approvals.c.seen != sa.null()) & (approvals.c.seen < cutoff))).scalars().all()
        for approval_id in ids:
            self.withdraw(approval_id, f"the flow that asked stopped polling for {self.lease_seconds:.0f}s (its "
                                       "process is gone)")
        if ids:
            logger.warning("withdrew %d approval request(s) whose flow is gone: %s", len(ids), ", ".join(ids))
        return list(ids)
