"""The ledger: budget holds and the evidence log, in one SQL database (SQLite or Postgres).

Amounts are stored as integer micro-units of each account's unit (money,
GPU-hours or tokens), so the books balance exactly. An admission or
settlement moves the budgets *and* appends its evidence record in the same
transaction, so neither can exist without the other. Serialisation: SQLite
takes its write lock at BEGIN (`BEGIN IMMEDIATE`); Postgres locks the chain
head, then the budget rows, with `SELECT ... FOR UPDATE`. Within one process,
concurrent writes are group-committed (see `Ledger`).

A hold is a two-phase reservation: `reserve` takes it (on every account the
run must fit, or on none), `settle` posts the actual charge and releases the
rest, exactly once. Each hold has a lease its holder renews while the task
runs; a hold whose lease ran out (its process died) expires and is charged in
full, because nobody knows what ran. Expiry is lazy: a reservation that would
not fit first expires what has run out on its accounts; `expire_holds` sweeps
everything (the CLI calls it).

The hot path (reserve, settle) runs pre-compiled SQL on the DBAPI cursor:
SQLAlchemy's per-statement construction and cache-key work cost more than
SQLite itself (measured: ~40 us per statement against ~4 us in SQLite).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from pydantic import BaseModel, ConfigDict
from sqlalchemy.engine import Connection, Engine

from blocks import BudgetLine, Grant
from aisched_prefect.evidence import (
    GENESIS,
    ChainReport,
    Checkpoint,
    EvidenceRecord,
    canonical,
    chain_hash,
    checkpoint_body,
    verify_chain,
    verify_checkpoints,
)

LEDGER_URL_ENV = "AISCHED_LEDGER_URL"
HOME_ENV = "AISCHED_HOME"
SCHEMA_VERSION = 5  # 2: delegated grants and revocations; 3: signed checkpoints; 4: units, leases, alerts; 5: flow versions
MICROS = 1_000_000
DEFAULT_LEASE_SECONDS = 300.0
ALERT_THRESHOLDS = (50, 80, 100)  # percent of a limit used (posted + held)
ALERT_REARM_POINTS = 5  # an alert fires again only after use fell this many points below it

metadata = sa.MetaData()

schema_version = sa.Table("aisched_schema", metadata, sa.Column("version", sa.Integer, nullable=False))

accounts = sa.Table(
    "aisched_budget_accounts", metadata,
    sa.Column("budget", sa.String(200), primary_key=True),
    sa.Column("period", sa.String(32), primary_key=True),
    sa.Column("limit_micros", sa.BigInteger, nullable=False),
    sa.Column("pending_micros", sa.BigInteger, nullable=False, default=0),
    sa.Column("posted_micros", sa.BigInteger, nullable=False, default=0),
    sa.Column("unit", sa.String(16), nullable=False, server_default="money"),
    sa.Column("alerted", sa.Integer, nullable=False, server_default="0"),
)

holds = sa.Table(
    "aisched_holds", metadata,
    sa.Column("id", sa.String(36), primary_key=True),
    sa.Column("budget", sa.String(200), nullable=False),
    sa.Column("period", sa.String(32), nullable=False),
    sa.Column("flow_run_id", sa.String(64)),
    sa.Column("task_run_id", sa.String(64), index=True),
    sa.Column("principal", sa.String(200)),
    sa.Column("reserved_micros", sa.BigInteger, nullable=False),
    sa.Column("charged_micros", sa.BigInteger),
    sa.Column("status", sa.String(16), nullable=False),  # pending | posted | voided | expired
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("settled_at", sa.Float),
    sa.Column("unit", sa.String(16), nullable=False, server_default="money"),
    sa.Column("lease_until", sa.Float),
    sa.Index("ix_aisched_holds_account", "budget", "period", "status"),
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

grants = sa.Table(
    "aisched_grants", metadata,
    sa.Column("id", sa.String(200), primary_key=True),
    sa.Column("parent", sa.String(200), nullable=False),
    sa.Column("principal", sa.String(200), nullable=False),
    sa.Column("body", sa.JSON, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("created_by", sa.String(200), nullable=False),
)

revocations = sa.Table(
    "aisched_revocations", metadata,
    sa.Column("grant_id", sa.String(200), primary_key=True),
    sa.Column("revoked_at", sa.Float, nullable=False),
    sa.Column("revoked_by", sa.String(200), nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
)

checkpoints = sa.Table(
    "aisched_checkpoints", metadata,
    sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("hash", sa.String(64), nullable=False),
    sa.Column("key_id", sa.String(64), nullable=False),
    sa.Column("signature", sa.String(128), nullable=False),
    sa.Column("ts", sa.Float, nullable=False),
)

flow_versions = sa.Table(
    "aisched_flow_versions", metadata,
    sa.Column("flow", sa.String(200), primary_key=True),
    sa.Column("version", sa.String(200), primary_key=True),
    sa.Column("first_admitted_at", sa.Float, nullable=False),
)

chain_head = sa.Table(
    "aisched_chain_head", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("hash", sa.String(64), nullable=False),
)

# Versioned migrations: what turns a ledger of version N-1 into version N (new tables are
# created by `create_all`; these are the changes to existing ones). Each runs once, in order.
MIGRATIONS: dict[int, list[str]] = {
    2: [],
    3: [],
    4: [
        "ALTER TABLE aisched_budget_accounts ADD COLUMN unit VARCHAR(16) NOT NULL DEFAULT 'money'",
        "ALTER TABLE aisched_budget_accounts ADD COLUMN alerted INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE aisched_holds ADD COLUMN unit VARCHAR(16) NOT NULL DEFAULT 'money'",
        "ALTER TABLE aisched_holds ADD COLUMN lease_until FLOAT",
        "CREATE INDEX IF NOT EXISTS ix_aisched_holds_account ON aisched_holds (budget, period, status)",
        "CREATE INDEX IF NOT EXISTS ix_aisched_holds_task_run_id ON aisched_holds (task_run_id)",
    ],
    5: [],  # aisched_flow_versions is a new table
}


def rolling_seconds(period: str) -> float | None:
    """The window of a rolling account ('rolling-7d' -> 7 days), or None for a calendar period."""
    return float(period.removeprefix("rolling-").removesuffix("d")) * 86_400.0 if period.startswith("rolling-") else None


def to_micros(amount: float) -> int:
    return int(round(amount * MICROS))


def from_micros(micros: int) -> float:
    return micros / MICROS


class BudgetExceeded(Exception):
    """A hold would take a budget past its limit."""

    def __init__(self, budget: str, period: str, limit: int, pending: int, posted: int, wanted: int,
                 unit: str = "money") -> None:
        self.budget, self.period, self.unit = budget, period, unit
        self.remaining = from_micros(limit - pending - posted)
        super().__init__(
            f"budget {budget!r} ({period}, {unit}) has {self.remaining:.4f} left of {from_micros(limit):.4f} "
            f"({from_micros(posted):.4f} posted, {from_micros(pending):.4f} held); this run needs "
            f"{from_micros(wanted):.4f}"
        )


class Hold(BaseModel):
    """A pending reservation on one budget account."""

    model_config = ConfigDict(frozen=True)

    id: str
    budget: str
    period: str
    reserved: float
    remaining_before: float
    remaining_after: float
    unit: str = "money"


class Settlement(BaseModel):
    """What a hold became: charged amount, released rest, and whether this call did it."""

    model_config = ConfigDict(frozen=True)

    hold_id: str
    charged: float
    released: float
    uncovered: float = 0.0
    status: str
    first: bool
    budget: str | None = None
    unit: str = "money"


class BudgetAlert(BaseModel):
    """A budget crossed a threshold (percent of its limit posted plus held)."""

    model_config = ConfigDict(frozen=True)

    budget: str
    period: str
    unit: str
    threshold: int
    used: float
    limit: float
    posted: float
    pending: float


def default_url() -> str:
    url = os.environ.get(LEDGER_URL_ENV)
    if url:
        return url
    home = Path(os.environ.get(HOME_ENV) or Path.home() / ".aisched")
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'ledger.db'}"


def make_engine(url: str, for_writes: bool = True) -> Engine:
    if url.startswith("sqlite"):
        engine = sa.create_engine(url, connect_args={"timeout": 60, "check_same_thread": False})

        @sa.event.listens_for(engine, "connect")
        def _sqlite_connect(dbapi_conn: Any, _: Any) -> None:
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA busy_timeout=60000")  # first: switching to WAL waits for other processes too
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        @sa.event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Connection) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE" if for_writes else "BEGIN")

        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://"):]
    return sa.create_engine(url, pool_pre_ping=True, pool_size=8, max_overflow=16)


class _Sql:
    """One statement compiled once for the ledger's dialect, run on the raw DBAPI cursor."""

    __slots__ = ("sql", "keys", "constants")

    def __init__(self, stmt: Any, dialect: sa.engine.Dialect) -> None:
        compiled = stmt.compile(dialect=dialect)
        self.sql = str(compiled)
        self.keys = list(compiled.positiontup) if compiled.positional else None
        self.constants = {k: v for k, v in compiled.params.items() if v is not None}  # literals in the statement

    def args(self, params: dict[str, Any]) -> Any:
        if self.constants:
            params = {**self.constants, **params}
        return tuple(params[k] for k in self.keys) if self.keys is not None else params

    def run(self, cur: Any, **params: Any) -> Any:
        cur.execute(self.sql, self.args(params))
        return cur

    def many(self, cur: Any, rows: list[dict[str, Any]]) -> None:
        cur.executemany(self.sql, [self.args(r) for r in rows])


class _Statements:
    """The hot path's statements for one dialect (locking reads on Postgres)."""

    def __init__(self, dialect: sa.engine.Dialect, locking: bool) -> None:
        def lock(q: Any) -> Any:
            return q.with_for_update() if locking else q

        b = sa.bindparam
        acct_where = (accounts.c.budget == b("k_budget")) & (accounts.c.period == b("k_period"))
        self.head = _Sql(lock(sa.select(chain_head.c.seq, chain_head.c.hash).where(chain_head.c.id == 1)), dialect)
        self.head_update = _Sql(chain_head.update().where(chain_head.c.id == 1).values(seq=b("v_seq"), hash=b("v_hash")), dialect)
        self.account = _Sql(lock(sa.select(accounts.c.limit_micros, accounts.c.pending_micros, accounts.c.posted_micros,
                                           accounts.c.alerted, accounts.c.unit).where(acct_where)), dialect)
        self.account_update = _Sql(accounts.update().where(acct_where).values(
            limit_micros=b("v_limit"), pending_micros=b("v_pending"), posted_micros=b("v_posted"),
            alerted=b("v_alerted"), unit=b("v_unit")), dialect)
        self.rolling_posted = _Sql(sa.select(sa.func.coalesce(sa.func.sum(holds.c.charged_micros), 0)).where(
            (holds.c.budget == b("k_budget")) & (holds.c.period == b("k_period"))
            & ((holds.c.status == "posted") | (holds.c.status == "expired")) & (holds.c.settled_at >= b("k_since"))), dialect)
        hold_cols = [c.name for c in holds.columns]
        self.hold_cols = hold_cols
        self.hold = _Sql(lock(sa.select(*holds.columns).where(holds.c.id == b("k_id"))), dialect)
        self.hold_insert = _Sql(holds.insert().values({c: b(f"v_{c}") for c in hold_cols}), dialect)
        self.hold_update = _Sql(holds.update().where(holds.c.id == b("k_id")).values(
            status=b("v_status"), charged_micros=b("v_charged"), settled_at=b("v_settled")), dialect)
        self.expired = _Sql(lock(sa.select(holds.c.id).where(
            (holds.c.budget == b("k_budget")) & (holds.c.period == b("k_period")) & (holds.c.status == "pending")
            & (holds.c.lease_until < b("k_now")))), dialect)
        self.revoked = _Sql(sa.select(revocations.c.grant_id), dialect)
        ev_cols = [c.name for c in evidence.columns]
        self.ev_cols = ev_cols
        self.evidence_insert = _Sql(evidence.insert().values({c: b(f"v_{c}") for c in ev_cols}), dialect)


class _Account:
    """One budget account as the current transaction sees it (micro-units)."""

    __slots__ = ("budget", "period", "unit", "limit", "pending", "posted", "alerted", "rolling", "dirty")

    def __init__(self, budget: str, period: str, row: tuple[int, int, int, int, str], rolling: float | None) -> None:
        self.budget, self.period, self.rolling = budget, period, rolling
        self.limit, self.pending, self.posted, self.alerted, self.unit = row
        self.dirty = False

    @property
    def free(self) -> int:
        return self.limit - self.pending - self.posted


class _Pending:
    """One write waiting for its group commit."""

    __slots__ = ("op", "done", "value", "error")

    def __init__(self, op: Callable[[_WriteBatch], Any]) -> None:
        self.op, self.done, self.value, self.error = op, False, None, None

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class _WriteBatch:
    """The writes of one transaction, applied in memory and flushed in a few statements.

    Each operation first checks everything it needs (and raises without
    touching the batch), then mutates the batch; so an operation refused
    half-way leaves no trace, and the others in the same transaction commit.
    (Lazy expiry is the exception by design: holds that ran out expire even if
    the reservation that looked at them is still refused.)
    """

    def __init__(self, conn: Connection, sql: _Statements, locking: bool) -> None:
        self.conn, self.sql, self.locking = conn, sql, locking
        self.cur = conn.connection.cursor()
        self.now = time.time()
        self.accounts: dict[tuple[str, str], _Account] = {}
        self.holds: dict[str, dict[str, Any]] = {}
        self.new_holds: set[str] = set()
        self.dirty_holds: set[str] = set()
        self.evidence: list[dict[str, Any]] = []
        self.alerts: list[BudgetAlert] = []
        # Every transaction locks the chain head first, then budget rows: one lock order everywhere.
        seq, head = sql.head.run(self.cur).fetchone()
        self._head: tuple[int, str] = (seq, head)

    def account(self, budget: str, period: str, line: BudgetLine | None = None) -> _Account:
        """The account (budget, period); `line` (from the block) creates it or updates its limit."""
        key = (budget, period)
        acct = self.accounts.get(key)
        if acct is None:
            row = self.sql.account.run(self.cur, k_budget=budget, k_period=period).fetchone()
            if row is None:
                if line is None:
                    raise LookupError(f"no budget account {budget!r} ({period}) in the ledger")
                values = dict(budget=budget, period=period, unit=line.unit, limit_micros=to_micros(line.limit),
                              pending_micros=0, posted_micros=0, alerted=0)
                if self.locking:
                    self.conn.execute(sa.dialects.postgresql.insert(accounts).values(**values).on_conflict_do_nothing())
                else:
                    self.conn.execute(accounts.insert().values(**values))
                row = self.sql.account.run(self.cur, k_budget=budget, k_period=period).fetchone()
            rolling = line.rolling_seconds if line is not None and line.rolling_seconds else rolling_seconds(period)
            acct = _Account(budget, period, tuple(row), rolling)  # type: ignore[arg-type]
            if rolling is not None:  # what counts is what was charged inside the window
                acct.posted = self.sql.rolling_posted.run(
                    self.cur, k_budget=budget, k_period=period, k_since=self.now - rolling).fetchone()[0]
                acct.dirty = True
            self.accounts[key] = acct
        if line is not None:
            if acct.limit != to_micros(line.limit) or acct.unit != line.unit:  # the operator edited the block
                acct.limit, acct.unit, acct.dirty = to_micros(line.limit), line.unit, True
        return acct

    def hold(self, hold_id: str) -> dict[str, Any]:
        if hold_id not in self.holds:
            row = self.sql.hold.run(self.cur, k_id=hold_id).fetchone()
            if row is None:
                raise LookupError(f"no hold {hold_id!r} in the ledger")
            self.holds[hold_id] = dict(zip(self.sql.hold_cols, row))
        return self.holds[hold_id]

    def expire(self, acct: _Account) -> list[dict[str, Any]]:
        """Expire the holds of `acct` whose lease ran out, charging each in full (outcome unknown)."""
        ids = [r[0] for r in self.sql.expired.run(self.cur, k_budget=acct.budget, k_period=acct.period,
                                                    k_now=self.now).fetchall()]
        gone = []
        for hold_id in ids:
            h = self.hold(hold_id)
            if h["status"] != "pending":
                continue
            self.post(acct, h, h["reserved_micros"], "expired")
            gone.append(h)
        if gone:
            self.append("hold-expired", {
                "budget": acct.budget, "period": acct.period, "unit": acct.unit,
                "holds": [{"id": h["id"], "task_run_id": h["task_run_id"], "charged": from_micros(h["charged_micros"])}
                          for h in gone],
                "rule": "a hold whose lease ran out is charged in full: its task's outcome is unknown"},
                {"flow_run_id": None, "task_run_id": None, "principal": None})
        return gone

    def post(self, acct: _Account, h: dict[str, Any], charge: int, status: str) -> int:
        """Turn a pending hold into `status`, charging at most what the account has room for."""
        reserved = h["reserved_micros"]
        room = acct.limit - (acct.pending - reserved) - acct.posted
        charged = min(charge, max(room, 0))
        acct.pending -= reserved
        acct.posted += charged
        acct.dirty = True
        h.update(status=status, charged_micros=charged, settled_at=self.now)
        self.dirty_holds.add(h["id"])
        return charged

    def append(self, kind: str, payload: dict[str, Any], ids: dict[str, Any]) -> EvidenceRecord:
        seq, prev = self._head[0] + 1, self._head[1]
        ts = time.time()
        h = chain_hash(prev, canonical(seq, ts, kind, ids["flow_run_id"], ids["task_run_id"], ids["principal"], payload))
        row = dict(seq=seq, ts=ts, kind=kind, payload=payload, prev_hash=prev, hash=h, **ids)
        self.evidence.append(row)
        self._head = (seq, h)
        return EvidenceRecord.model_construct(**row)

    def _check_alerts(self) -> None:
        for acct in self.accounts.values():
            if not acct.dirty or acct.limit <= 0:
                continue
            used = acct.pending + acct.posted
            level = max((t for t in ALERT_THRESHOLDS if used * 100 >= t * acct.limit), default=0)
            if level > acct.alerted:
                for t in ALERT_THRESHOLDS:
                    if acct.alerted < t <= level:
                        self.alerts.append(BudgetAlert(
                            budget=acct.budget, period=acct.period, unit=acct.unit, threshold=t,
                            used=used / acct.limit, limit=from_micros(acct.limit),
                            posted=from_micros(acct.posted), pending=from_micros(acct.pending)))
                acct.alerted = level
            elif level < acct.alerted and used * 100 < (acct.alerted - ALERT_REARM_POINTS) * acct.limit:
                acct.alerted = level
        if self.alerts:
            self.append("budget-alert", {"alerts": [a.model_dump() for a in self.alerts]},
                        {"flow_run_id": None, "task_run_id": None, "principal": None})

    def flush(self) -> None:
        sql, cur = self.sql, self.cur
        self._check_alerts()
        dirty = [a for a in self.accounts.values() if a.dirty]
        if dirty:
            sql.account_update.many(cur, [dict(k_budget=a.budget, k_period=a.period, v_limit=a.limit, v_pending=a.pending,
                                               v_posted=a.posted, v_alerted=a.alerted, v_unit=a.unit) for a in dirty])
        if self.new_holds:
            sql.hold_insert.many(cur, [{f"v_{c}": self.holds[i][c] for c in sql.hold_cols} for i in sorted(self.new_holds)])
        changed = self.dirty_holds - self.new_holds
        if changed:
            sql.hold_update.many(cur, [{"k_id": i, "v_status": self.holds[i]["status"], "v_charged": self.holds[i]["charged_micros"],
                                        "v_settled": self.holds[i]["settled_at"]} for i in sorted(changed)])
        if self.evidence:
            sql.evidence_insert.many(cur, [{f"v_{c}": json.dumps(r[c]) if c == "payload" else r[c] for c in sql.ev_cols}
                                           for r in self.evidence])
            sql.head_update.run(cur, v_seq=self._head[0], v_hash=self._head[1])


class Ledger:
    """Budget holds and the evidence chain over one SQLAlchemy engine.

    Writes from the threads of one process are group-committed: whoever takes
    the write lock runs every write queued so far in one transaction. Under
    load (hundreds of task threads) this replaces hundreds of small
    transactions, each paying the GIL hand-off on every database call, with a
    few large ones; alone, a write is still one transaction of its own.
    """

    def __init__(self, url: str | None = None, *, lease_seconds: float = DEFAULT_LEASE_SECONDS,
                 on_alert: Callable[[BudgetAlert], None] | None = None) -> None:
        self.url = url or default_url()
        self.engine = make_engine(self.url)
        self._locking = self.engine.dialect.name != "sqlite"
        # Reads need no write lock: SQLite in WAL mode lets them run beside the writer.
        self.reader = make_engine(self.url, for_writes=False) if not self._locking else self.engine
        self.lease_seconds = lease_seconds
        self.on_alert = on_alert
        self._sql = _Statements(self.engine.dialect, self._locking)
        self._write_lock = threading.Lock()
        self._queue: list[_Pending] = []
        self._queue_lock = threading.Lock()
        self._migrate()

    def close(self) -> None:
        self.engine.dispose()
        self.reader.dispose()

    # -- schema -------------------------------------------------------------------------
    def _migrate(self) -> None:
        with self.engine.begin() as conn:
            if self._locking:  # two processes opening a fresh Postgres ledger: one creates, the other waits
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(7324180041)"))
            fresh = not sa.inspect(conn).has_table(schema_version.name)
            if fresh:
                metadata.create_all(conn)
                conn.execute(schema_version.insert().values(version=SCHEMA_VERSION))
                conn.execute(chain_head.insert().values(id=1, seq=0, hash=GENESIS))
                return
            version = conn.execute(sa.select(schema_version.c.version)).scalar() or 0
            if version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"ledger {self.url} has schema version {version}, newer than this aisched-prefect "
                    f"({SCHEMA_VERSION}): upgrade aisched-prefect"
                )
            for target in range(version + 1, SCHEMA_VERSION + 1):
                for statement in MIGRATIONS[target]:
                    conn.exec_driver_sql(statement)
            metadata.create_all(conn, checkfirst=True)  # tables added since `version`
            if version < SCHEMA_VERSION:
                conn.execute(schema_version.update().values(version=SCHEMA_VERSION))

    # -- group commit -------------------------------------------------------------------
    def _write(self, op: Callable[[_WriteBatch], Any]) -> Any:
        pending = _Pending(op)
        with self._queue_lock:
            self._queue.append(pending)
        alerts: list[BudgetAlert] = []
        with self._write_lock:
            if not pending.done:
                with self._queue_lock:
                    batch, self._queue = self._queue, []
                alerts = self._commit(batch)
        for alert in alerts:  # after the commit and outside the lock: a slow hook delays no write
            if self.on_alert is not None:
                self.on_alert(alert)
        return pending.result()

    def _commit(self, batch: list[_Pending]) -> list[BudgetAlert]:
        try:
            with self.engine.begin() as conn:
                writes = _WriteBatch(conn, self._sql, self._locking)
                for p in batch:
                    try:
                        p.value = p.op(writes)
                    except (BudgetExceeded, LookupError) as exc:  # refused before touching the batch
                        p.error = exc
                writes.flush()
            return writes.alerts
        except BaseException as exc:  # the transaction is gone: every write in it failed
            for p in batch:
                if p.error is None:
                    p.error = exc if isinstance(exc, Exception) else RuntimeError(f"ledger write aborted: {exc!r}")
                    p.value = None
            if not isinstance(exc, Exception):
                raise
            return []
        finally:
            for p in batch:
                p.done = True

    # -- evidence -----------------------------------------------------------------------
    def record(self, kind: str, payload: dict[str, Any], *, flow_run_id: str | None = None,
               task_run_id: str | None = None, principal: str | None = None) -> EvidenceRecord:
        """Append one evidence record on its own."""
        ids = {"flow_run_id": flow_run_id, "task_run_id": task_run_id, "principal": principal}
        return self._write(lambda w: w.append(kind, payload, ids))

    def records(self, flow_run_id: str | None = None) -> list[EvidenceRecord]:
        with self.reader.connect() as conn:
            return self._records(conn, flow_run_id)

    def records_about(self, run_id: str) -> list[EvidenceRecord]:
        """Records of a flow run or of a task run, in order."""
        q = sa.select(evidence).where((evidence.c.flow_run_id == run_id) | (evidence.c.task_run_id == run_id))
        with self.reader.connect() as conn:
            return [EvidenceRecord.model_construct(**row._mapping) for row in conn.execute(q.order_by(evidence.c.seq))]

    @staticmethod
    def _records(conn: Connection, flow_run_id: str | None = None) -> list[EvidenceRecord]:
        q = sa.select(evidence).order_by(evidence.c.seq)
        if flow_run_id is not None:
            q = q.where(evidence.c.flow_run_id == flow_run_id)
        # Rows come from our own table: construct without re-validating (the chain check is the validation).
        return [EvidenceRecord.model_construct(**row._mapping) for row in conn.execute(q)]

    def verify(self, public_key: bytes | None = None) -> ChainReport:
        """Check the chain; with the checkpoint key's public half, check the signed checkpoints too."""
        with self.reader.connect() as conn:  # one snapshot: the head and the log it should end at
            head = conn.execute(sa.select(chain_head.c.seq, chain_head.c.hash)).first()
            records = self._records(conn)
            report = verify_chain(records, tuple(head) if head else None)
            if not report.ok or public_key is None:
                return report
            signed = [Checkpoint(**row._mapping) for row in conn.execute(sa.select(checkpoints).order_by(checkpoints.c.seq))]
        return verify_checkpoints(records, signed, public_key)

    def checkpoint(self, private_key: Ed25519PrivateKey) -> Checkpoint:
        """Sign the current head of the log and keep the signature in the ledger."""
        public = private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        key_id = hashlib.sha256(public).hexdigest()[:16]

        def op(w: _WriteBatch) -> Checkpoint:
            seq, head = w._head
            cp = Checkpoint(seq=seq, hash=head, key_id=key_id, ts=time.time(),
                            signature=private_key.sign(checkpoint_body(seq, head)).hex())
            if w.conn.execute(sa.select(checkpoints.c.seq).where(checkpoints.c.seq == seq)).first() is None:
                w.conn.execute(checkpoints.insert().values(**cp.model_dump()))
            return cp

        return self._write(op)

    # -- budget -------------------------------------------------------------------------
    def reserve(self, lines: list[BudgetLine], amount: float | None = None, *, kind: str, payload: dict[str, Any],
                flow_run_id: str | None, task_run_id: str | None, principal: str | None,
                lease_seconds: float | None = None) -> tuple[list[Hold], EvidenceRecord]:
        """Hold each line's amount on its account (all or none) and record `kind` evidence.

        `amount`, when given, is held on every line instead of the line's own.
        The holds' lease runs `lease_seconds` (default: the ledger's); renew it
        with `renew` while the work runs.
        """
        ids = {"flow_run_id": flow_run_id, "task_run_id": task_run_id, "principal": principal}
        ordered = sorted(lines, key=lambda l: (l.budget, l.period))  # one lock order for every process
        wants = [to_micros(line.amount if amount is None else amount) for line in ordered]
        lease = self.lease_seconds if lease_seconds is None else lease_seconds

        def op(w: _WriteBatch) -> tuple[list[Hold], EvidenceRecord]:
            accts = [w.account(line.budget, line.period, line) for line in ordered]
            for acct, wanted in zip(accts, wants):
                if wanted > acct.free:
                    w.expire(acct)  # lazily: only a reservation that needs the room looks for run-out leases
                if wanted > acct.free:
                    raise BudgetExceeded(acct.budget, acct.period, acct.limit, acct.pending, acct.posted, wanted, acct.unit)
            taken = []
            for line, acct, wanted in zip(ordered, accts, wants):
                remaining = from_micros(acct.free)
                acct.pending += wanted
                acct.dirty = True
                hold_id = str(uuid.uuid4())
                w.holds[hold_id] = dict(id=hold_id, budget=acct.budget, period=acct.period, reserved_micros=wanted,
                                        charged_micros=None, status="pending", created_at=w.now, settled_at=None,
                                        unit=acct.unit, lease_until=w.now + lease, **ids)
                w.new_holds.add(hold_id)
                taken.append(Hold(id=hold_id, budget=acct.budget, period=acct.period, reserved=from_micros(wanted),
                                  remaining_before=remaining, remaining_after=from_micros(acct.free), unit=acct.unit))
            rec = w.append(kind, {**payload, "holds": [h.model_dump() for h in taken]}, ids)
            return taken, rec

        return self._write(op)

    def settle(self, hold_ids: list[str], actual: float | dict[str, float] | None, *, kind: str, payload: dict[str, Any],
               flow_run_id: str | None, task_run_id: str | None, principal: str | None) -> tuple[list[Settlement], EvidenceRecord | None]:
        """Post the actual charge against the holds and release the rest, exactly once.

        `actual`: None voids every hold; a number is charged on each hold's
        account; a dict gives the charge per budget account (holds of accounts
        it leaves out are voided). Several holds of one account (a run and its
        top-ups) share its charge in the order they were taken. A charge above
        the holds takes what the budgets still have (the same share of the
        excess on every account, so a team's spend stays the sum of its flows')
        and records the rest as uncovered, so spend never passes a limit. Settling twice changes
        nothing and records nothing the second time.
        """
        ids = {"flow_run_id": flow_run_id, "task_run_id": task_run_id, "principal": principal}

        def op(w: _WriteBatch) -> tuple[list[Settlement], EvidenceRecord | None]:
            found = sorted((w.hold(i) for i in set(hold_ids)), key=lambda h: (h["budget"], h["period"], h["created_at"], h["id"]))
            done: dict[str, Settlement] = {}
            wants: dict[str, int] = {}  # pending hold id -> what it should be charged
            left: dict[str, int] = {}
            last_of = {h["budget"]: h["id"] for h in found if h["status"] == "pending"}
            for h in found:
                if h["status"] != "pending":
                    charged = h["charged_micros"] or 0
                    done[h["id"]] = Settlement(hold_id=h["id"], charged=from_micros(charged),
                                               released=from_micros(h["reserved_micros"] - charged),
                                               status=h["status"], first=False, budget=h["budget"], unit=h["unit"])
                elif actual is None or (isinstance(actual, dict) and h["budget"] not in actual):
                    w.post(w.account(h["budget"], h["period"]), h, 0, "voided")
                    done[h["id"]] = Settlement(hold_id=h["id"], charged=0.0, released=from_micros(h["reserved_micros"]),
                                               status="voided", first=True, budget=h["budget"], unit=h["unit"])
                else:
                    if h["budget"] not in left:
                        left[h["budget"]] = to_micros(actual if not isinstance(actual, dict) else actual[h["budget"]])
                    share = left[h["budget"]] if last_of[h["budget"]] == h["id"] else min(left[h["budget"]], h["reserved_micros"])
                    left[h["budget"]] -= share
                    wants[h["id"]] = share
            # Charges within their holds post as they are. Charges above them post only the share of the
            # excess that *every* account of this run has room for, so nested budgets stay equal.
            over = {i: want - w.holds[i]["reserved_micros"] for i, want in wants.items() if want > w.holds[i]["reserved_micros"]}
            for i, want in wants.items():
                if i not in over:
                    w.post(w.account(w.holds[i]["budget"], w.holds[i]["period"]), w.holds[i], want, "posted")
            fraction = 1.0
            for i, excess in over.items():
                acct = w.account(w.holds[i]["budget"], w.holds[i]["period"])
                fraction = min(fraction, max(acct.free, 0) / excess)
            for i, excess in over.items():
                h = w.holds[i]
                w.post(w.account(h["budget"], h["period"]), h, h["reserved_micros"] + int(excess * fraction), "posted")
            for i, want in wants.items():
                h = w.holds[i]
                done[i] = Settlement(hold_id=i, charged=from_micros(h["charged_micros"]),
                                     released=from_micros(max(h["reserved_micros"] - h["charged_micros"], 0)),
                                     uncovered=from_micros(want - h["charged_micros"]), status="posted", first=True,
                                     budget=h["budget"], unit=h["unit"])
            out = [done[h["id"]] for h in found]
            if out and not any(s.first for s in out):  # settled before: nothing changes, nothing is recorded
                return out, None
            return out, w.append(kind, {**payload, "settlements": [s.model_dump() for s in out]}, ids)

        return self._write(op)

    def renew(self, hold_ids: list[str], lease_seconds: float | None = None) -> set[str]:
        """Extend the lease of pending holds that have not run out; returns the ids renewed.

        Touches only the holds' rows (no chain head, no account): a renewal can
        neither block nor deadlock a reservation.
        """
        if not hold_ids:
            return set()
        now = time.time()
        until = now + (self.lease_seconds if lease_seconds is None else lease_seconds)
        where = holds.c.id.in_(sorted(set(hold_ids))) & (holds.c.status == "pending") & (holds.c.lease_until >= now)
        with self.engine.begin() as conn:
            renewed = {r[0] for r in conn.execute(sa.select(holds.c.id).where(where))}
            if renewed:
                conn.execute(holds.update().where(holds.c.id.in_(sorted(renewed))).values(lease_until=until))
        return renewed

    def expire_holds(self) -> list[str]:
        """Expire every hold whose lease ran out (charged in full); returns their ids."""
        with self.reader.connect() as conn:
            keys = conn.execute(sa.select(holds.c.budget, holds.c.period).where(
                (holds.c.status == "pending") & (holds.c.lease_until < time.time())).distinct()).all()
        if not keys:
            return []

        def op(w: _WriteBatch) -> list[str]:
            return [h["id"] for b, p in sorted(keys) for h in w.expire(w.account(b, p))]

        return self._write(op)

    def history(self, budget: str | None = None, *, task_run_id: str | None = None, limit: int = 200) -> list[dict[str, Any]]:
        """Holds and charges, newest first: what each task run held, was charged and released."""
        q = sa.select(holds).order_by(holds.c.created_at.desc(), holds.c.id).limit(limit)
        if budget is not None:
            q = q.where((holds.c.budget == budget) | holds.c.budget.like(f"{budget}/%"))
        if task_run_id is not None:
            q = q.where(holds.c.task_run_id == task_run_id)
        with self.reader.connect() as conn:
            rows = conn.execute(q).all()
        return [{"hold": r.id, "budget": r.budget, "period": r.period, "unit": r.unit, "status": r.status,
                 "reserved": from_micros(r.reserved_micros),
                 "charged": None if r.charged_micros is None else from_micros(r.charged_micros),
                 "flow_run_id": r.flow_run_id, "task_run_id": r.task_run_id, "principal": r.principal,
                 "created_at": r.created_at, "settled_at": r.settled_at, "lease_until": r.lease_until} for r in rows]

    # -- delegated grants and revocations ------------------------------------------------
    def add_grant(self, grant: Grant, *, by: str) -> EvidenceRecord:
        """Store a delegated grant (already checked against its parent) and record the delegation."""
        if grant.parent is None:
            raise ValueError(f"grant {grant.id!r} has no parent: root grants live in the AuthorityBlock")

        def op(w: _WriteBatch) -> EvidenceRecord:
            if w.conn.execute(sa.select(grants.c.id).where(grants.c.id == grant.id)).first() is not None:
                raise LookupError(f"a grant {grant.id!r} already exists: choose another id")
            w.conn.execute(grants.insert().values(
                id=grant.id, parent=grant.parent, principal=grant.principal,
                body=grant.model_dump(mode="json"), created_at=time.time(), created_by=by))
            return w.append("delegation", {"grant": grant.model_dump(mode="json"), "by": by},
                            {"flow_run_id": None, "task_run_id": None, "principal": by})

        return self._write(op)

    def revoke(self, grant_id: str, *, by: str, reason: str) -> EvidenceRecord | None:
        """Revoke a grant (root or delegated) and so everything delegated from it; once."""

        def op(w: _WriteBatch) -> EvidenceRecord | None:
            if w.conn.execute(sa.select(revocations.c.grant_id).where(revocations.c.grant_id == grant_id)).first():
                return None
            w.conn.execute(revocations.insert().values(grant_id=grant_id, revoked_at=time.time(),
                                                       revoked_by=by, reason=reason))
            return w.append("revocation", {"grant": grant_id, "by": by, "reason": reason},
                            {"flow_run_id": None, "task_run_id": None, "principal": by})

        return self._write(op)

    def delegated_grants(self) -> dict[str, Grant]:
        with self.reader.connect() as conn:
            return {row.id: Grant.model_validate(row.body) for row in conn.execute(sa.select(grants.c.id, grants.c.body))}

    def flow_version_seen(self, flow: str, version: str) -> bool:
        """Whether a run of this flow at this version was ever admitted."""
        with self.reader.connect() as conn:
            return conn.execute(sa.select(flow_versions.c.flow).where(
                (flow_versions.c.flow == flow) & (flow_versions.c.version == version))).first() is not None

    def mark_flow_version(self, flow: str, version: str) -> None:
        """Remember that a run of this flow version was admitted (once; later calls change nothing)."""
        try:
            with self.engine.begin() as conn:
                if conn.execute(sa.select(flow_versions.c.flow).where(
                        (flow_versions.c.flow == flow) & (flow_versions.c.version == version))).first() is None:
                    conn.execute(flow_versions.insert().values(flow=flow, version=version, first_admitted_at=time.time()))
        except sa.exc.IntegrityError:  # another process marked it first
            pass

    def revoked_ids(self) -> set[str]:
        """Every revoked grant id. Read at each admission, so on the raw cursor: one statement, no ORM-side work."""
        conn = self.reader.raw_connection()
        try:
            cur = conn.cursor()
            cur.execute(self._sql.revoked.sql)
            ids = {row[0] for row in cur.fetchall()}
            cur.close()
            conn.commit()  # end the read (a snapshot on Postgres) before the connection goes back to the pool
            return ids
        finally:
            conn.close()

    def account(self, budget: str, period: str) -> dict[str, Any] | None:
        rows = [a for a in self.accounts() if a["budget"] == budget and a["period"] == period]
        return {k: rows[0][k] for k in ("limit", "pending", "posted", "remaining")} if rows else None

    def accounts(self) -> list[dict[str, Any]]:
        """Every budget account: limit, posted, pending and remaining (rolling windows: posted inside the window)."""
        now = time.time()
        with self.reader.connect() as conn:
            rows = conn.execute(sa.select(accounts).order_by(accounts.c.budget, accounts.c.period)).all()
            out = []
            for r in rows:
                posted, window = r.posted_micros, rolling_seconds(r.period)
                if window is not None:  # the same sum the ledger's writes use
                    q = self._sql.rolling_posted
                    posted = conn.exec_driver_sql(q.sql, q.args({"k_budget": r.budget, "k_period": r.period,
                                                                 "k_since": now - window})).scalar()
                out.append({"budget": r.budget, "period": r.period, "unit": r.unit, "limit": from_micros(r.limit_micros),
                            "pending": from_micros(r.pending_micros), "posted": from_micros(posted),
                            "remaining": from_micros(r.limit_micros - r.pending_micros - posted),
                            "alerted": r.alerted})
        return out
