"""The ledger: budget holds and the evidence log, in one SQL database (SQLite or Postgres).

Amounts are stored as integer micro-units of the budget's currency, so the
books balance exactly. Every admission or settlement is one transaction that
moves the budget *and* appends its evidence record, so neither can exist
without the other. Serialisation: SQLite takes its write lock at BEGIN
(`BEGIN IMMEDIATE`); Postgres locks the budget rows and the chain head with
`SELECT ... FOR UPDATE`, always in the same order.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict
from sqlalchemy.engine import Connection, Engine

from aisched_prefect.evidence import GENESIS, ChainReport, EvidenceRecord, canonical, chain_hash, verify_chain

LEDGER_URL_ENV = "AISCHED_LEDGER_URL"
HOME_ENV = "AISCHED_HOME"
SCHEMA_VERSION = 1
MICROS = 1_000_000

metadata = sa.MetaData()

schema_version = sa.Table("aisched_schema", metadata, sa.Column("version", sa.Integer, nullable=False))

accounts = sa.Table(
    "aisched_budget_accounts", metadata,
    sa.Column("budget", sa.String(200), primary_key=True),
    sa.Column("period", sa.String(32), primary_key=True),
    sa.Column("limit_micros", sa.BigInteger, nullable=False),
    sa.Column("pending_micros", sa.BigInteger, nullable=False, default=0),
    sa.Column("posted_micros", sa.BigInteger, nullable=False, default=0),
)

holds = sa.Table(
    "aisched_holds", metadata,
    sa.Column("id", sa.String(36), primary_key=True),
    sa.Column("budget", sa.String(200), nullable=False),
    sa.Column("period", sa.String(32), nullable=False),
    sa.Column("flow_run_id", sa.String(64)),
    sa.Column("task_run_id", sa.String(64)),
    sa.Column("principal", sa.String(200)),
    sa.Column("reserved_micros", sa.BigInteger, nullable=False),
    sa.Column("charged_micros", sa.BigInteger),
    sa.Column("status", sa.String(16), nullable=False),  # pending | posted | voided
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("settled_at", sa.Float),
)

evidence = sa.Table(
    "aisched_evidence", metadata,
    sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("ts", sa.Float, nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("flow_run_id", sa.String(64), index=True),
    sa.Column("task_run_id", sa.String(64), index=True),
    sa.Column("principal", sa.String(200)),
    sa.Column("payload", sa.JSON, nullable=False),
    sa.Column("prev_hash", sa.String(64), nullable=False),
    sa.Column("hash", sa.String(64), nullable=False),
)

chain_head = sa.Table(
    "aisched_chain_head", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("hash", sa.String(64), nullable=False),
)


def to_micros(amount: float) -> int:
    return int(round(amount * MICROS))


def from_micros(micros: int) -> float:
    return micros / MICROS


class BudgetExceeded(Exception):
    """A hold would take a budget past its limit."""

    def __init__(self, budget: str, period: str, limit: int, pending: int, posted: int, wanted: int) -> None:
        self.remaining = from_micros(limit - pending - posted)
        super().__init__(
            f"budget {budget!r} ({period}) has {self.remaining:.4f} left of {from_micros(limit):.2f} "
            f"({from_micros(posted):.4f} posted, {from_micros(pending):.4f} held); this run needs "
            f"{from_micros(wanted):.4f}"
        )


class BudgetLine(BaseModel):
    """One budget the hold must fit: its name, window and limit."""

    model_config = ConfigDict(frozen=True)

    budget: str
    period: str
    limit: float


class Hold(BaseModel):
    """A pending reservation on one budget."""

    model_config = ConfigDict(frozen=True)

    id: str
    budget: str
    period: str
    reserved: float
    remaining_before: float
    remaining_after: float


class Settlement(BaseModel):
    """What a hold became: charged amount, released rest, and whether this call did it."""

    model_config = ConfigDict(frozen=True)

    hold_id: str
    charged: float
    released: float
    uncovered: float = 0.0
    status: str
    first: bool


def default_url() -> str:
    url = os.environ.get(LEDGER_URL_ENV)
    if url:
        return url
    home = Path(os.environ.get(HOME_ENV) or Path.home() / ".aisched")
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'ledger.db'}"


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = sa.create_engine(url, connect_args={"timeout": 60, "check_same_thread": False})

        @sa.event.listens_for(engine, "connect")
        def _sqlite_connect(dbapi_conn: Any, _: Any) -> None:
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=60000")
            cur.close()

        @sa.event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Connection) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://"):]
    return sa.create_engine(url, pool_pre_ping=True, pool_size=8, max_overflow=16)


class Ledger:
    """Budget holds and the evidence chain over one SQLAlchemy engine."""

    def __init__(self, url: str | None = None) -> None:
        self.url = url or default_url()
        self.engine = make_engine(self.url)
        self._locking = self.engine.dialect.name != "sqlite"
        # SQLite has one writer at a time; threads of this process queue here rather
        # than in SQLite's busy handler, which sleeps in growing steps. Other
        # processes still serialize on BEGIN IMMEDIATE.
        self._write_lock = threading.Lock() if not self._locking else None
        self._migrate()

    def close(self) -> None:
        self.engine.dispose()

    # -- schema -------------------------------------------------------------------------
    def _migrate(self) -> None:
        with self.engine.begin() as conn:
            metadata.create_all(conn, checkfirst=True)
            version = conn.execute(sa.select(schema_version.c.version)).scalar()
            if version is None:
                conn.execute(schema_version.insert().values(version=SCHEMA_VERSION))
                conn.execute(chain_head.insert().values(id=1, seq=0, hash=GENESIS))
            elif version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"ledger {self.url} has schema version {version}, newer than this aisched-prefect "
                    f"({SCHEMA_VERSION}): upgrade aisched-prefect"
                )

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        if self._write_lock is None:
            with self.engine.begin() as conn:
                yield conn
            return
        with self._write_lock, self.engine.begin() as conn:
            yield conn

    # -- evidence -----------------------------------------------------------------------
    def _append(self, conn: Connection, kind: str, payload: dict[str, Any], *, flow_run_id: str | None,
                task_run_id: str | None, principal: str | None) -> EvidenceRecord:
        q = sa.select(chain_head.c.seq, chain_head.c.hash).where(chain_head.c.id == 1)
        if self._locking:
            q = q.with_for_update()
        seq, prev = conn.execute(q).one()
        seq += 1
        ts = time.time()
        h = chain_hash(prev, canonical(seq, ts, kind, flow_run_id, task_run_id, principal, payload))
        conn.execute(evidence.insert().values(
            seq=seq, ts=ts, kind=kind, flow_run_id=flow_run_id, task_run_id=task_run_id,
            principal=principal, payload=payload, prev_hash=prev, hash=h))
        conn.execute(chain_head.update().where(chain_head.c.id == 1).values(seq=seq, hash=h))
        return EvidenceRecord(seq=seq, ts=ts, kind=kind, flow_run_id=flow_run_id, task_run_id=task_run_id,
                              principal=principal, payload=payload, prev_hash=prev, hash=h)

    def record(self, kind: str, payload: dict[str, Any], *, flow_run_id: str | None = None,
               task_run_id: str | None = None, principal: str | None = None) -> EvidenceRecord:
        """Append one evidence record on its own."""
        with self.transaction() as conn:
            return self._append(conn, kind, payload, flow_run_id=flow_run_id,
                                task_run_id=task_run_id, principal=principal)

    def records(self, flow_run_id: str | None = None) -> list[EvidenceRecord]:
        q = sa.select(evidence).order_by(evidence.c.seq)
        if flow_run_id is not None:
            q = q.where(evidence.c.flow_run_id == flow_run_id)
        with self.engine.connect() as conn:
            return [EvidenceRecord(**row._mapping) for row in conn.execute(q)]

    def verify(self) -> ChainReport:
        with self.engine.connect() as conn:
            head = conn.execute(sa.select(chain_head.c.seq, chain_head.c.hash)).first()
        return verify_chain(self.records(), tuple(head) if head else None)

    # -- budget -------------------------------------------------------------------------
    def _lock_account(self, conn: Connection, line: BudgetLine) -> tuple[int, int, int]:
        key = (accounts.c.budget == line.budget) & (accounts.c.period == line.period)
        q = sa.select(accounts.c.limit_micros, accounts.c.pending_micros, accounts.c.posted_micros).where(key)
        if self._locking:
            q = q.with_for_update()
        row = conn.execute(q).first()
        limit = to_micros(line.limit)
        if row is None:
            if self._locking:
                stmt = sa.dialects.postgresql.insert(accounts).values(
                    budget=line.budget, period=line.period, limit_micros=limit, pending_micros=0, posted_micros=0
                ).on_conflict_do_nothing()
                conn.execute(stmt)
            else:
                conn.execute(accounts.insert().values(
                    budget=line.budget, period=line.period, limit_micros=limit, pending_micros=0, posted_micros=0))
            row = conn.execute(q).one()
        if row[0] != limit:  # the operator changed the limit in the block
            conn.execute(accounts.update().where(key).values(limit_micros=limit))
        return limit, row[1], row[2]

    def reserve(self, lines: list[BudgetLine], amount: float, *, kind: str, payload: dict[str, Any],
                flow_run_id: str | None, task_run_id: str | None, principal: str | None) -> tuple[list[Hold], EvidenceRecord]:
        """Hold `amount` on every budget in `lines` (all or none) and record `kind` evidence."""
        wanted = to_micros(amount)
        with self.transaction() as conn:
            taken: list[Hold] = []
            for line in sorted(lines, key=lambda l: (l.budget, l.period)):
                limit, pending, posted = self._lock_account(conn, line)
                if pending + posted + wanted > limit:
                    raise BudgetExceeded(line.budget, line.period, limit, pending, posted, wanted)
                hold_id = str(uuid.uuid4())
                conn.execute(accounts.update().where(
                    (accounts.c.budget == line.budget) & (accounts.c.period == line.period)
                ).values(pending_micros=accounts.c.pending_micros + wanted))
                conn.execute(holds.insert().values(
                    id=hold_id, budget=line.budget, period=line.period, flow_run_id=flow_run_id,
                    task_run_id=task_run_id, principal=principal, reserved_micros=wanted,
                    status="pending", created_at=time.time()))
                remaining = from_micros(limit - pending - posted)
                taken.append(Hold(id=hold_id, budget=line.budget, period=line.period, reserved=amount,
                                  remaining_before=remaining, remaining_after=remaining - from_micros(wanted)))
            rec = self._append(conn, kind, {**payload, "holds": [h.model_dump() for h in taken]},
                               flow_run_id=flow_run_id, task_run_id=task_run_id, principal=principal)
            return taken, rec

    def settle(self, hold_ids: list[str], actual: float | None, *, kind: str, payload: dict[str, Any],
               flow_run_id: str | None, task_run_id: str | None, principal: str | None) -> tuple[list[Settlement], EvidenceRecord | None]:
        """Post `actual` (None = void) against each hold and release the rest, exactly once.

        A charge above the hold takes what the budget still has and records the
        rest as uncovered, so spend never passes the limit. Settling a hold twice
        changes nothing and records nothing the second time.
        """
        out: list[Settlement] = []
        with self.transaction() as conn:
            for hold_id in sorted(hold_ids):
                q = sa.select(holds).where(holds.c.id == hold_id)
                if self._locking:
                    q = q.with_for_update()
                h = conn.execute(q).one()._mapping
                if h["status"] != "pending":
                    charged = h["charged_micros"] or 0
                    out.append(Settlement(hold_id=hold_id, charged=from_micros(charged),
                                          released=from_micros(h["reserved_micros"] - charged),
                                          status=h["status"], first=False))
                    continue
                line_key = (accounts.c.budget == h["budget"]) & (accounts.c.period == h["period"])
                aq = sa.select(accounts.c.limit_micros, accounts.c.pending_micros, accounts.c.posted_micros).where(line_key)
                if self._locking:
                    aq = aq.with_for_update()
                limit, pending, posted = conn.execute(aq).one()
                reserved = h["reserved_micros"]
                want = 0 if actual is None else to_micros(actual)
                room = limit - (pending - reserved) - posted
                charged = min(want, max(room, 0))
                conn.execute(accounts.update().where(line_key).values(
                    pending_micros=accounts.c.pending_micros - reserved,
                    posted_micros=accounts.c.posted_micros + charged))
                status = "voided" if actual is None else "posted"
                conn.execute(holds.update().where(holds.c.id == hold_id).values(
                    status=status, charged_micros=charged, settled_at=time.time()))
                out.append(Settlement(hold_id=hold_id, charged=from_micros(charged),
                                      released=from_micros(max(reserved - charged, 0)),
                                      uncovered=from_micros(want - charged), status=status, first=True))
            if not any(s.first for s in out):
                return out, None
            rec = self._append(conn, kind, {**payload, "settlements": [s.model_dump() for s in out]},
                               flow_run_id=flow_run_id, task_run_id=task_run_id, principal=principal)
            return out, rec

    def account(self, budget: str, period: str) -> dict[str, float] | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(accounts).where(
                (accounts.c.budget == budget) & (accounts.c.period == period))).first()
        if row is None:
            return None
        m = row._mapping
        return {"limit": from_micros(m["limit_micros"]), "pending": from_micros(m["pending_micros"]),
                "posted": from_micros(m["posted_micros"]),
                "remaining": from_micros(m["limit_micros"] - m["pending_micros"] - m["posted_micros"])}

    def accounts(self) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(accounts).order_by(accounts.c.budget, accounts.c.period)).all()
        return [{"budget": r.budget, "period": r.period, "limit": from_micros(r.limit_micros),
                 "pending": from_micros(r.pending_micros), "posted": from_micros(r.posted_micros),
                 "remaining": from_micros(r.limit_micros - r.pending_micros - r.posted_micros)} for r in rows]
