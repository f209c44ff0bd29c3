"""The Ledger: budget holds, the versioned limits, and the evidence log, over one SQL database (SQLite or Postgres).

An admission or settlement moves the budgets *and* appends its evidence
record in the same transaction, so neither can exist without the other.
Every amount is checked here, at the door, before anything is queued: a
refused call changes nothing. Writes from the threads of one process are
group-committed (`commit.py`); the rules of the books are in `budget.py`
and `limits.py`; reads that reports use are in `queries.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy.engine import Connection

from aisched_prefect.errors import InvalidLedgerInput
from aisched_prefect.evidence import ChainReport, Checkpoint, EvidenceRecord
from aisched_prefect.ledger import authority, evidence_log, queries
from aisched_prefect.ledger.amounts import check_amount, check_lease, femtos
from aisched_prefect.ledger.batch import WriteBatch
from aisched_prefect.ledger.budget import expire_op, renew_op, reserve_op, settle_op
from aisched_prefect.ledger.commit import GroupCommit, Pending
from aisched_prefect.ledger.engine import default_url, make_engine
from aisched_prefect.ledger.limits import apply_limits_op, check_line, check_version, checked_lines
from aisched_prefect.ledger.records import BudgetAlert, Hold, LimitsApplied, Settlement
from aisched_prefect.ledger.schema import migrate
from aisched_prefect.ledger.statements import Statements
from blocks import BudgetLine, Grant

DEFAULT_LEASE_SECONDS = 300.0
CLOCK_REFRESH = 30.0  # seconds between readings of the database clock's offset from this host's


def _ids(flow_run_id: str | None, task_run_id: str | None, principal: str | None) -> dict[str, Any]:
    return {"flow_run_id": flow_run_id, "task_run_id": task_run_id, "principal": principal}


def _hold_ids(hold_ids: object) -> list[str]:
    if isinstance(hold_ids, str) or not all(isinstance(i, str) for i in hold_ids):  # type: ignore[union-attr]
        raise InvalidLedgerInput("hold_ids", hold_ids, "hold ids are a list of strings", "pass [hold.id for hold in holds]")
    return list(dict.fromkeys(hold_ids))  # type: ignore[arg-type]


def _charges(actual: object) -> int | dict[str, int] | None:
    """`actual` in femto-units, every amount checked."""
    fix = "charge what the run used: a number from 0 to 1e12 (None voids the holds)"
    if actual is None:
        return None
    if isinstance(actual, dict):
        out = {}
        for budget, amount in actual.items():
            if not isinstance(budget, str):
                raise InvalidLedgerInput("actual", actual, "charges are keyed by budget name", fix)
            out[budget] = femtos(check_amount(f"actual[{budget!r}]", amount, fix=fix))
        return out
    return femtos(check_amount("actual", actual, fix=fix))


def _and_then(op: Callable[[WriteBatch], Any], then: Callable[[WriteBatch, Any], None]) -> Callable[[WriteBatch], Any]:
    """`op`, then the caller's own writes given its result, in the same transaction; `op`'s result."""
    def both(w: WriteBatch) -> Any:
        done = op(w)
        then(w, done)
        return done

    return both


class Ledger:
    """Budget holds, versioned limits and the evidence chain over one SQLAlchemy engine."""

    def __init__(self, url: str | None = None, *, lease_seconds: float = DEFAULT_LEASE_SECONDS,
                 on_alert: Callable[[BudgetAlert], None] | None = None, signer: Callable[[bytes], str] | None = None) -> None:
        """`signer`: signs every record this ledger appends (the control plane's key), so a record written by
        anyone else with access to the database is told apart (`verify(public_key, signed_records=True)`)."""
        self.url = url or default_url()
        self.lease_seconds = check_lease(lease_seconds)
        self.engine = make_engine(self.url)
        self._locking = self.engine.dialect.name != "sqlite"
        # Reads need no write lock: SQLite in WAL mode lets them run beside the writer.
        self.reader = make_engine(self.url, for_writes=False) if not self._locking else self.engine
        self.on_alert = on_alert
        self._sql = Statements(self.engine.dialect)
        self._commits = GroupCommit(self.engine, self._sql, self._alerts, signer)
        migrate(self.engine, self.url)
        self._offset: tuple[float, float] | None = None  # (database clock - this host's, when it was read: monotonic)

    def now(self) -> datetime:
        """The database's clock, as UTC: the calendar period a charge falls into is the same on every replica,
        whatever its host's clock says. Its offset from this host's clock is read at most every CLOCK_REFRESH s."""
        offset = self._offset
        if offset is None or time.monotonic() - offset[1] > CLOCK_REFRESH:
            with self.reader.connect() as conn:
                host = time.time()
                offset = self._offset = (queries.db_now(conn) - host, time.monotonic())
        return datetime.fromtimestamp(time.time() + offset[0], timezone.utc)

    def close(self) -> None:
        self._commits.close()
        self.engine.dispose()
        self.reader.dispose()

    # -- group commit -------------------------------------------------------------------
    def _write(self, op: Callable[[WriteBatch], Any]) -> Any:
        """Run `op(batch)` in a write transaction (group-committed with other threads' writes); return its value.

        `batch.conn` is the transaction's SQLAlchemy Connection, `batch.append(kind, payload, ids)`
        appends an evidence record, `batch.now` is the database's clock. The op may run again
        (after a deadlock, or another op's failure): it must do all its work through the batch.
        """
        return self._commits.write(op)

    def write(self, op: Callable[[Connection], Any]) -> Any:
        """Run `op(conn)` in the next group-committed write transaction and return its value.

        For the control plane's tables beside the books (the call book): a run's bookkeeping then shares the
        transactions of other runs' holds and settlements instead of taking the write lock once per row. The op
        may run again (after a deadlock, or another op's failure) and should not raise for an expected outcome
        (an insert that finds its row: `insert_new`), since that rolls the whole group back once."""
        return self._write(lambda w: op(w.conn))

    @property
    def _write_lock(self) -> Any:
        return self._commits.lock

    @property
    def _queue(self) -> list[Pending]:
        return self._commits.queue

    def _alerts(self, alerts: list[BudgetAlert]) -> None:
        if self.on_alert is not None:
            for alert in alerts:
                self.on_alert(alert)

    # -- evidence -----------------------------------------------------------------------
    def record(self, kind: str, payload: dict[str, Any], *, flow_run_id: str | None = None,
               task_run_id: str | None = None, principal: str | None = None) -> EvidenceRecord:
        """Append one evidence record on its own."""
        ids = _ids(flow_run_id, task_run_id, principal)
        return self._write(lambda w: w.append(kind, payload, ids))

    def records(self, flow_run_id: str | None = None) -> list[EvidenceRecord]:
        with self.reader.connect() as conn:
            return evidence_log.read_records(conn, flow_run_id)

    def records_after(self, seq: int, limit: int | None = None) -> list[EvidenceRecord]:
        """Records after record `seq`, in order (at most `limit`)."""
        import sqlalchemy as sa

        from aisched_prefect.ledger.schema import evidence

        q = sa.select(evidence).where(evidence.c.seq > seq).order_by(evidence.c.seq)
        if limit is not None:
            q = q.limit(limit)
        with self.reader.connect() as conn:
            return [EvidenceRecord.model_construct(**row._mapping) for row in conn.execute(q)]

    def records_about(self, run_id: str) -> list[EvidenceRecord]:
        """Records of a flow run or of a task run, in order."""
        return evidence_log.records_about(self.reader, run_id)

    def verify(self, public_key: bytes | None = None, signed_records: bool = False) -> ChainReport:
        """Check the chain; with the control plane's public key, its signed checkpoints too, and (`signed_records`)
        that every record carries its signature."""
        return evidence_log.verify(self.reader, public_key, signed_records)

    def checkpoint(self, private_key: Ed25519PrivateKey) -> Checkpoint:
        """Sign the current head of the log and keep the signature in the ledger."""
        return self._write(evidence_log.checkpoint_op(private_key))

    # -- budget -------------------------------------------------------------------------
    def reserve(self, lines: list[BudgetLine], amount: float | None = None, *, kind: str, payload: dict[str, Any],
                flow_run_id: str | None, task_run_id: str | None, principal: str | None,
                lease_seconds: float | None = None,
                also: Callable[[Any, list[Hold], EvidenceRecord], None] | None = None) -> tuple[list[Hold], EvidenceRecord]:
        """Hold each line's amount on its account (all or none, one group) and record `kind` evidence.

        `amount`, when given, is held on every line instead of the line's own. The same account
        twice is one hold of the sum. The group's lease runs `lease_seconds` (default: the
        ledger's); renew it with `renew` while the work runs. Raises BudgetExceeded when an
        account has no room, InvalidAmount for an amount that is not a finite number from 0 to 1e12.
        `also(conn, holds, record)` writes the caller's own rows in the same transaction (on the
        same database): they are committed with the holds or not at all.
        """
        checked = checked_lines(lines, amount)
        lease = self.lease_seconds if lease_seconds is None else check_lease(lease_seconds)
        op = reserve_op(checked, lease, kind, payload, _ids(flow_run_id, task_run_id, principal))
        return self._write(op if also is None else _and_then(op, lambda w, done: also(w.conn, *done)))

    def settle(self, hold_ids: list[str], actual: float | dict[str, float] | None, *, kind: str, payload: dict[str, Any],
               flow_run_id: str | None, task_run_id: str | None,
               principal: str | None, also: Callable[[Any], None] | None = None,
               ) -> tuple[list[Settlement], EvidenceRecord | None]:
        """Post the actual charge against the holds and release the rest, exactly once.

        The holds' groups are settled whole: every hold of each reservation they belong to.
        `actual`: None voids every hold; a number is charged on each hold's account; a dict
        gives the charge per budget account (holds of accounts it leaves out are voided).
        Several holds of one account (a run and its top-ups) share its charge in the order
        they were taken. A charge above the holds takes what the budgets still have (the same
        share of the excess on every account, so a team's spend stays the sum of its flows')
        and records the rest as uncovered, so spend never passes a limit. Settling twice, or
        nothing, changes nothing and records nothing.
        `also(conn)` writes the caller's own rows in the same transaction, as `reserve`'s does (it runs
        again if the settlement is retried; a settlement found done runs it too).
        """
        ids = _hold_ids(hold_ids)
        charges = _charges(actual)
        if not ids:  # nothing to settle: the caller's rows are still written
            if also is not None:
                self._write(lambda w: also(w.conn))
            return [], None
        op = settle_op(ids, charges, kind, payload, _ids(flow_run_id, task_run_id, principal))
        return self._write(op if also is None else _and_then(op, lambda w, _: also(w.conn)))

    def renew(self, hold_ids: list[str], lease_seconds: float | None = None) -> set[str]:
        """Extend the lease of the holds' groups that have not run out; returns the hold ids renewed."""
        ids = _hold_ids(hold_ids)
        lease = self.lease_seconds if lease_seconds is None else check_lease(lease_seconds)
        if not ids:
            return set()
        return self._write(renew_op(ids, lease))

    def expire_holds(self) -> list[str]:
        """Expire every group whose lease ran out (by the database's clock), charged in full; returns the hold ids."""
        if not queries.any_expired(self.reader):
            return []
        return self._write(expire_op())

    def apply_limits(self, lines: list[BudgetLine], version: int, *, by: str | None = None) -> LimitsApplied:
        """Apply version `version` of the budget configuration: each line's limit, unit and window for its budget.

        A budget whose stored version is newer (or this one, with other values) is left as it is
        and named in `stale`. The limit applies to every account of the budget, in every period,
        from the next reservation on, in every process. Lines' periods and amounts are ignored.
        """
        version = check_version(version)
        checked = [check_line(line, f"lines[{i}]")[0] for i, line in enumerate(lines)]
        return self._write(apply_limits_op(checked, version, by))

    def record_with_limits(self, kind: str, payload: dict[str, Any], limits: list[tuple[list[BudgetLine], int]], *,
                           by: str | None = None) -> EvidenceRecord:
        """Append one record and apply these versions of the budget configuration with it, in one transaction.

        An applied configuration and the limits it sets are kept together or not at all: every line is
        checked here, before anything is written (InvalidLedgerInput names the first that cannot be booked),
        and a failure on the way leaves neither behind.
        """
        checked = [([check_line(line, f"lines[{i}]")[0] for i, line in enumerate(lines)], check_version(version))
                   for lines, version in limits]
        ids = _ids(None, None, by)

        def op(w: WriteBatch) -> EvidenceRecord:
            record = w.append(kind, payload, ids)
            for lines, version in checked:
                apply_limits_op(lines, version, by)(w)
            return record

        return self._write(op)

    def limits(self) -> list[dict[str, Any]]:
        """The applied configuration of every budget that has one: limit, unit, window and version."""
        return queries.list_limits(self.reader)

    def history(self, budget: str | None = None, *, task_run_id: str | None = None, limit: int = 200) -> list[dict[str, Any]]:
        """Holds and charges, newest first: what each task run held, was charged and released."""
        return queries.history(self.reader, budget, task_run_id=task_run_id, limit=limit)

    def account(self, budget: str, period: str) -> dict[str, Any] | None:
        rows = [a for a in self.accounts() if a["budget"] == budget and a["period"] == period]
        return {k: rows[0][k] for k in ("limit", "pending", "posted", "remaining")} if rows else None

    def accounts(self) -> list[dict[str, Any]]:
        """Every budget account: limit, posted, pending and remaining (rolling windows: posted inside the window)."""
        return queries.list_accounts(self.reader)

    # -- delegated grants, revocations, flow versions ------------------------------------
    def add_grant(self, grant: Grant, *, by: str) -> EvidenceRecord:
        """Store a delegated grant (already checked against its parent) and record the delegation."""
        return self._write(authority.add_grant_op(grant, by))

    def revoke(self, grant_id: str, *, by: str, reason: str) -> EvidenceRecord | None:
        """Revoke a grant (root or delegated) and so everything delegated from it; once."""
        return self._write(authority.revoke_op(grant_id, by, reason))

    def delegated_grants(self) -> dict[str, Grant]:
        return authority.delegated_grants(self.reader)

    def revoked_ids(self) -> set[str]:
        """Every revoked grant id (read at each admission)."""
        return authority.revoked_ids(self.reader, self._sql.revoked.sql)

    def flow_version_seen(self, flow: str, version: str) -> bool:
        """Whether a run of this flow at this version was ever admitted."""
        return authority.flow_version_seen(self.reader, flow, version)

    def mark_flow_version(self, flow: str, version: str) -> None:
        """Remember that a run of this flow version was admitted (once; later calls change nothing)."""
        self._write(authority.mark_flow_version_op(flow, version))
