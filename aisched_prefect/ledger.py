"""The ledger: budget holds and the evidence log, in one SQL database (SQLite or Postgres).

Amounts are stored as integer micro-units of the budget's currency, so the
books balance exactly. An admission or settlement moves the budget *and*
appends its evidence record in the same transaction, so neither can exist
without the other. Serialisation: SQLite takes its write lock at BEGIN
(`BEGIN IMMEDIATE`); Postgres locks the chain head, then the budget rows,
with `SELECT ... FOR UPDATE`. Within one process, concurrent writes are
group-committed (see `Ledger`).
"""

from __future__ import annotations

import hashlib
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

from blocks import Grant
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
SCHEMA_VERSION = 3  # 2: delegated grants and revocations; 3: signed checkpoints
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
    """

    def __init__(self, conn: Connection, locking: bool) -> None:
        self.conn, self.locking = conn, locking
        self.accounts: dict[tuple[str, str], list[int]] = {}  # [limit, pending, posted]
        self.dirty_accounts: set[tuple[str, str]] = set()
        self.holds: dict[str, dict[str, Any]] = {}
        self.new_holds: set[str] = set()
        self.dirty_holds: set[str] = set()
        self.evidence: list[dict[str, Any]] = []
        # Every transaction locks the chain head first, then budget rows: one lock order everywhere.
        q = sa.select(chain_head.c.seq, chain_head.c.hash).where(chain_head.c.id == 1)
        self._head: tuple[int, str] = tuple(self._select(q).one())  # type: ignore[assignment]

    def _select(self, q: Any) -> Any:
        return self.conn.execute(q.with_for_update() if self.locking else q)

    def account(self, budget: str, period: str, limit: int | None = None) -> list[int]:
        """[limit, pending, posted] in micros; `limit` (from the block) creates or updates the row."""
        key = (budget, period)
        if key not in self.accounts:
            where = (accounts.c.budget == budget) & (accounts.c.period == period)
            q = sa.select(accounts.c.limit_micros, accounts.c.pending_micros, accounts.c.posted_micros).where(where)
            row = self._select(q).first()
            if row is None:
                if limit is None:
                    raise LookupError(f"no budget account {budget!r} ({period}) in the ledger")
                values = dict(budget=budget, period=period, limit_micros=limit, pending_micros=0, posted_micros=0)
                if self.locking:
                    self.conn.execute(sa.dialects.postgresql.insert(accounts).values(**values).on_conflict_do_nothing())
                else:
                    self.conn.execute(accounts.insert().values(**values))
                row = self._select(q).one()
            self.accounts[key] = list(row)
        acct = self.accounts[key]
        if limit is not None and acct[0] != limit:  # the operator changed the limit in the block
            acct[0] = limit
            self.dirty_accounts.add(key)
        return acct

    def hold(self, hold_id: str) -> dict[str, Any]:
        if hold_id not in self.holds:
            row = self._select(sa.select(holds).where(holds.c.id == hold_id)).first()
            if row is None:
                raise LookupError(f"no hold {hold_id!r} in the ledger")
            self.holds[hold_id] = dict(row._mapping)
        return self.holds[hold_id]

    def append(self, kind: str, payload: dict[str, Any], ids: dict[str, Any]) -> EvidenceRecord:
        seq, prev = self._head[0] + 1, self._head[1]
        ts = time.time()
        h = chain_hash(prev, canonical(seq, ts, kind, ids["flow_run_id"], ids["task_run_id"], ids["principal"], payload))
        row = dict(seq=seq, ts=ts, kind=kind, payload=payload, prev_hash=prev, hash=h, **ids)
        self.evidence.append(row)
        self._head = (seq, h)
        return EvidenceRecord(**row)

    def flush(self) -> None:
        c = self.conn
        for budget, period in self.dirty_accounts:
            limit, pending, posted = self.accounts[(budget, period)]
            c.execute(accounts.update().where((accounts.c.budget == budget) & (accounts.c.period == period))
                      .values(limit_micros=limit, pending_micros=pending, posted_micros=posted))
        if self.new_holds:
            c.execute(holds.insert(), [self.holds[i] for i in sorted(self.new_holds)])
        changed = self.dirty_holds - self.new_holds
        if changed:
            c.execute(holds.update().where(holds.c.id == sa.bindparam("hid")).values(
                status=sa.bindparam("status"), charged_micros=sa.bindparam("charged_micros"),
                settled_at=sa.bindparam("settled_at")),
                [{"hid": i, "status": self.holds[i]["status"], "charged_micros": self.holds[i]["charged_micros"],
                  "settled_at": self.holds[i]["settled_at"]} for i in sorted(changed)])
        if self.evidence:
            c.execute(evidence.insert(), self.evidence)
            c.execute(chain_head.update().where(chain_head.c.id == 1).values(seq=self._head[0], hash=self._head[1]))


class Ledger:
    """Budget holds and the evidence chain over one SQLAlchemy engine.

    Writes from the threads of one process are group-committed: whoever takes
    the write lock runs every write queued so far in one transaction. Under
    load (hundreds of task threads) this replaces hundreds of small
    transactions, each paying the GIL hand-off on every database call, with a
    few large ones; alone, a write is still one transaction of its own.
    """

    def __init__(self, url: str | None = None) -> None:
        self.url = url or default_url()
        self.engine = make_engine(self.url)
        self._locking = self.engine.dialect.name != "sqlite"
        # Reads need no write lock: SQLite in WAL mode lets them run beside the writer.
        self.reader = make_engine(self.url, for_writes=False) if not self._locking else self.engine
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
            elif version < SCHEMA_VERSION:  # every migration so far only adds tables (created above)
                conn.execute(schema_version.update().values(version=SCHEMA_VERSION))

    # -- group commit -------------------------------------------------------------------
    def _write(self, op: Callable[[_WriteBatch], Any]) -> Any:
        pending = _Pending(op)
        with self._queue_lock:
            self._queue.append(pending)
        with self._write_lock:
            if not pending.done:
                with self._queue_lock:
                    batch, self._queue = self._queue, []
                self._commit(batch)
        return pending.result()

    def _commit(self, batch: list[_Pending]) -> None:
        try:
            with self.engine.begin() as conn:
                writes = _WriteBatch(conn, self._locking)
                for p in batch:
                    try:
                        p.value = p.op(writes)
                    except (BudgetExceeded, LookupError) as exc:  # refused before touching the batch
                        p.error = exc
                writes.flush()
        except BaseException as exc:  # the transaction is gone: every write in it failed
            for p in batch:
                if p.error is None:
                    p.error = exc if isinstance(exc, Exception) else RuntimeError(f"ledger write aborted: {exc!r}")
                    p.value = None
            if not isinstance(exc, Exception):
                raise
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
    def reserve(self, lines: list[BudgetLine], amount: float, *, kind: str, payload: dict[str, Any],
                flow_run_id: str | None, task_run_id: str | None, principal: str | None) -> tuple[list[Hold], EvidenceRecord]:
        """Hold `amount` on every budget in `lines` (all or none) and record `kind` evidence."""
        wanted = to_micros(amount)
        ids = {"flow_run_id": flow_run_id, "task_run_id": task_run_id, "principal": principal}
        ordered = sorted(lines, key=lambda l: (l.budget, l.period))

        def op(w: _WriteBatch) -> tuple[list[Hold], EvidenceRecord]:
            accts = [w.account(line.budget, line.period, to_micros(line.limit)) for line in ordered]
            for line, (limit, pending, posted) in zip(ordered, accts):
                if pending + posted + wanted > limit:
                    raise BudgetExceeded(line.budget, line.period, limit, pending, posted, wanted)
            taken = []
            for line, acct in zip(ordered, accts):
                remaining = from_micros(acct[0] - acct[1] - acct[2])
                acct[1] += wanted
                w.dirty_accounts.add((line.budget, line.period))
                hold_id = str(uuid.uuid4())
                w.holds[hold_id] = dict(id=hold_id, budget=line.budget, period=line.period, reserved_micros=wanted,
                                        charged_micros=None, status="pending", created_at=time.time(),
                                        settled_at=None, **ids)
                w.new_holds.add(hold_id)
                taken.append(Hold(id=hold_id, budget=line.budget, period=line.period, reserved=amount,
                                  remaining_before=remaining, remaining_after=remaining - from_micros(wanted)))
            rec = w.append(kind, {**payload, "holds": [h.model_dump() for h in taken]}, ids)
            return taken, rec

        return self._write(op)

    def settle(self, hold_ids: list[str], actual: float | None, *, kind: str, payload: dict[str, Any],
               flow_run_id: str | None, task_run_id: str | None, principal: str | None) -> tuple[list[Settlement], EvidenceRecord | None]:
        """Post `actual` (None = void) against each hold and release the rest, exactly once.

        A charge above the hold takes what the budget still has and records the
        rest as uncovered, so spend never passes the limit. Settling a hold twice
        changes nothing and records nothing the second time.
        """
        ids = {"flow_run_id": flow_run_id, "task_run_id": task_run_id, "principal": principal}
        want = 0 if actual is None else to_micros(actual)

        def op(w: _WriteBatch) -> tuple[list[Settlement], EvidenceRecord | None]:
            found = [w.hold(i) for i in sorted(hold_ids)]
            out: list[Settlement] = []
            for h in found:
                if h["status"] != "pending":
                    charged = h["charged_micros"] or 0
                    out.append(Settlement(hold_id=h["id"], charged=from_micros(charged),
                                          released=from_micros(h["reserved_micros"] - charged),
                                          status=h["status"], first=False))
                    continue
                acct = w.account(h["budget"], h["period"])
                reserved = h["reserved_micros"]
                room = acct[0] - (acct[1] - reserved) - acct[2]
                charged = min(want, max(room, 0))
                acct[1] -= reserved
                acct[2] += charged
                w.dirty_accounts.add((h["budget"], h["period"]))
                h.update(status="voided" if actual is None else "posted", charged_micros=charged, settled_at=time.time())
                w.dirty_holds.add(h["id"])
                out.append(Settlement(hold_id=h["id"], charged=from_micros(charged),
                                      released=from_micros(max(reserved - charged, 0)),
                                      uncovered=from_micros(want - charged), status=h["status"], first=True))
            if not any(s.first for s in out):
                return out, None
            return out, w.append(kind, {**payload, "settlements": [s.model_dump() for s in out]}, ids)

        return self._write(op)

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

    def revoked_ids(self) -> set[str]:
        with self.reader.connect() as conn:
            return set(conn.execute(sa.select(revocations.c.grant_id)).scalars())

    def account(self, budget: str, period: str) -> dict[str, float] | None:
        with self.reader.connect() as conn:
            row = conn.execute(sa.select(accounts).where(
                (accounts.c.budget == budget) & (accounts.c.period == period))).first()
        if row is None:
            return None
        m = row._mapping
        return {"limit": from_micros(m["limit_micros"]), "pending": from_micros(m["pending_micros"]),
                "posted": from_micros(m["posted_micros"]),
                "remaining": from_micros(m["limit_micros"] - m["pending_micros"] - m["posted_micros"])}

    def accounts(self) -> list[dict[str, Any]]:
        with self.reader.connect() as conn:
            rows = conn.execute(sa.select(accounts).order_by(accounts.c.budget, accounts.c.period)).all()
        return [{"budget": r.budget, "period": r.period, "limit": from_micros(r.limit_micros),
                 "pending": from_micros(r.pending_micros), "posted": from_micros(r.posted_micros),
                 "remaining": from_micros(r.limit_micros - r.pending_micros - r.posted_micros)} for r in rows]
