"""What reports and the CLI read from the ledger: accounts, holds and the runs they belong to.

Reads run on the reader engine (on SQLite, beside the writer), and measure
rolling windows by the database's clock, as the writes do.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from aisched_prefect.ledger.amounts import from_micros
from aisched_prefect.ledger.engine import clock
from aisched_prefect.ledger.limits import rolling_seconds
from aisched_prefect.ledger.schema import accounts, budget_limits, evidence, holds

SETTLED_KINDS = ("settlement", "warm-idle")  # evidence kinds that close a run (or a warm body's idle time)
ASKED_KINDS = ("admission", "approval-requested", "top-up")


def db_now(conn: Connection) -> float:
    """The database's clock (Unix seconds)."""
    return float(conn.execute(sa.select(clock(conn.dialect))).scalar_one())


def list_accounts(reader: Engine) -> list[dict[str, Any]]:
    """Every budget account: limit, posted, pending and remaining (rolling windows: posted inside the window)."""
    with reader.connect() as conn:
        now = db_now(conn)
        rows = conn.execute(sa.select(accounts, budget_limits.c.rolling_seconds.label("window"))
                            .select_from(accounts.outerjoin(budget_limits, budget_limits.c.budget == accounts.c.budget))
                            .order_by(accounts.c.budget, accounts.c.period)).all()
        out = []
        for r in rows:
            posted, window = int(r.posted_micros), r.window or rolling_seconds(r.period)
            if window is not None:  # the same sum the ledger's writes use
                posted = int(conn.execute(sa.select(sa.func.coalesce(sa.func.sum(holds.c.charged_micros), 0)).where(
                    (holds.c.budget == r.budget) & (holds.c.period == r.period)
                    & holds.c.status.in_(("posted", "expired")) & (holds.c.settled_at >= now - window))).scalar_one())
            limit, pending = int(r.limit_micros), int(r.pending_micros)
            out.append({"budget": r.budget, "period": r.period, "unit": r.unit, "limit": from_micros(limit),
                        "pending": from_micros(pending), "posted": from_micros(posted),
                        "remaining": from_micros(limit - pending - posted), "alerted": r.alerted})
    return out


def list_limits(reader: Engine) -> list[dict[str, Any]]:
    """The applied configuration of every budget that has one: limit, unit, window, version."""
    with reader.connect() as conn:
        rows = conn.execute(sa.select(budget_limits).order_by(budget_limits.c.budget)).all()
    return [{"budget": r.budget, "limit": from_micros(int(r.limit_micros)), "unit": r.unit,
             "rolling_seconds": r.rolling_seconds, "version": int(r.version), "applied_at": r.applied_at} for r in rows]


def history(reader: Engine, budget: str | None = None, *, task_run_id: str | None = None,
            limit: int = 200) -> list[dict[str, Any]]:
    """Holds and charges, newest first: what each task run held, was charged and released."""
    q = sa.select(holds).order_by(holds.c.created_at.desc(), holds.c.reserved_seq.desc(), holds.c.id).limit(limit)
    if budget is not None:
        q = q.where((holds.c.budget == budget) | holds.c.budget.like(f"{budget}/%"))
    if task_run_id is not None:
        q = q.where(holds.c.task_run_id == task_run_id)
    with reader.connect() as conn:
        rows = conn.execute(q).all()
    return [{"hold": r.id, "budget": r.budget, "period": r.period, "unit": r.unit, "status": r.status,
             "reserved": from_micros(r.reserved_micros),
             "charged": None if r.charged_micros is None else from_micros(r.charged_micros),
             "flow_run_id": r.flow_run_id, "task_run_id": r.task_run_id, "principal": r.principal,
             "created_at": r.created_at, "settled_at": r.settled_at, "lease_until": r.lease_until,
             "group": r.group_id} for r in rows]


def any_expired(reader: Engine) -> bool:
    """Whether some pending hold's lease ran out (by the database's clock): a sweep has work to do."""
    with reader.connect() as conn:
        return conn.execute(sa.select(holds.c.id).where(
            (holds.c.status == "pending") & (holds.c.lease_until < clock(conn.dialect))).limit(1)).first() is not None


def _window(column: Any, since: datetime | None, until: datetime | None) -> Any:
    """`column` (epoch seconds) within [since, until), widened by a minute: a candidate filter, made exact later."""
    cond = sa.true()
    if since is not None:
        cond = cond & (column >= since.timestamp() - 60)
    if until is not None:
        cond = cond & (column < until.timestamp() + 60)
    return cond


def settled_runs(reader: Engine, flow_run_id: str | None = None, since: datetime | None = None,
                 until: datetime | None = None) -> tuple[list[Any], list[Any]]:
    """Settled holds and the evidence that describes their runs, in one read transaction.

    With a window, only runs settled near it are read whole (every hold, the admission): a day's
    report does not decode the whole evidence log.
    """
    hq = sa.select(holds).where(holds.c.status != "pending")
    eq = sa.select(evidence.c.seq, evidence.c.ts, evidence.c.kind, evidence.c.flow_run_id, evidence.c.task_run_id,
                   evidence.c.principal, evidence.c.payload).where(evidence.c.kind.in_(SETTLED_KINDS + ASKED_KINDS))
    if flow_run_id is not None:
        hq, eq = hq.where(holds.c.flow_run_id == flow_run_id), eq.where(evidence.c.flow_run_id == flow_run_id)
    with reader.connect() as conn:
        if since is None and until is None:
            return (conn.execute(hq.order_by(holds.c.created_at, holds.c.id)).all(),
                    conn.execute(eq.order_by(evidence.c.seq)).all())
        near = conn.execute(sa.union(
            sa.select(holds.c.task_run_id).where((holds.c.status != "pending") & _window(holds.c.settled_at, since, until)),
            sa.select(evidence.c.task_run_id).where((evidence.c.kind.in_(SETTLED_KINDS)) & _window(evidence.c.ts, since, until)),
        )).scalars().all()
        runs = sorted(r for r in near if r is not None)
        found_h: list[Any] = []
        found_e: list[Any] = []
        for i in range(0, len(runs), 500):  # under every backend's limit of bound parameters
            chunk = runs[i:i + 500]
            found_h += conn.execute(hq.where(holds.c.task_run_id.in_(chunk))).all()
            found_e += conn.execute(eq.where(evidence.c.task_run_id.in_(chunk))).all()
    return sorted(found_h, key=lambda h: (h.created_at, h.id)), sorted(found_e, key=lambda r: r.seq)
