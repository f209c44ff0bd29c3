"""Group commit: the writes of one process's threads, run together in few transactions, each write on its own.

Whoever takes the write lock runs every write queued so far in one
transaction: under load (hundreds of task threads) this replaces hundreds of
small transactions, each paying the GIL hand-off on every database call, with
a few large ones; alone, a write is still one transaction of its own.

Each write is isolated. A write that raises a refusal (`BudgetExceeded`)
raises before it changes the books, or after changes that stand on their own
(expired leases), and the rest commit with it. A write that raises anything
else fails alone: the transaction is rolled back and the others run again
without it. A transaction that fails for no write's fault (a deadlock, a
serialization failure, a lost connection) runs again, a few times, before any
write hears of it; one that fails at commit for a reason no write owns runs
each write in a transaction of its own, so only the culprit fails.

A write runs again after such a failure: it must do everything through the
batch it is given (and `batch.conn`), nothing it cannot repeat.

A dropped connection (the server ended the session: `pg_terminate_backend`,
a restart, a failover) is such a failure: the dead connection is discarded,
never handed back to the pool, and the transaction runs again on a new one.
Where it dropped during COMMIT, the outcome is unknown: the batch's last
evidence record (its seq and hash are unique) is read back, so a batch that
did commit is not written twice; a batch that appended no evidence holds only
writes that are safe to repeat (renewals, marks, checkpoints). What still
fails after the retries fails with `LedgerUnavailable`, naming the cause.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from aisched_prefect.errors import LedgerUnavailable
from aisched_prefect.ledger.batch import WriteBatch
from aisched_prefect.ledger.engine import described, dropped, retryable, safe_url
from aisched_prefect.ledger.schema import evidence
from aisched_prefect.ledger.records import BudgetAlert, BudgetExceeded
from aisched_prefect.ledger.statements import Statements

MAX_RETRIES = 8


class Pending:
    """One write waiting for its group commit: woken once it is done, or (not done) once it is its turn to lead."""

    __slots__ = ("op", "done", "value", "error", "woken")

    def __init__(self, op: Callable[[WriteBatch], Any]) -> None:
        self.op, self.done, self.value, self.error = op, False, None, None
        self.woken = threading.Event()

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class _OpFailed(Exception):
    """One write raised: roll back, and run the others without it."""

    def __init__(self, pending: Pending, error: Exception) -> None:
        self.pending, self.error = pending, error


class _CommitUnknown(Exception):
    """The connection dropped during COMMIT: the transaction may or may not have committed."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class GroupCommit:
    """The write path of one Ledger: a queue, one writer at a time, one connection kept open for it."""

    def __init__(self, engine: Engine, sql: Statements, on_alerts: Callable[[list[BudgetAlert]], None],
                 signer: Callable[[bytes], str] | None = None) -> None:
        self.engine, self.sql, self.on_alerts, self.signer = engine, sql, on_alerts, signer
        self.sqlite = engine.dialect.name == "sqlite"
        self.lock = threading.Lock()
        self.queue: list[Pending] = []
        self.queue_lock = threading.Lock()
        self._leading = False  # a thread is committing, or is about to: every other write waits to be woken
        self._conn: Connection | None = None
        self.retries = 0  # transactions run again after a deadlock, serialization failure or lost connection

    def write(self, op: Callable[[WriteBatch], Any]) -> Any:
        """Queue `op`; the one writer leading commits every write queued so far, and wakes each of them (or hands the
        lead to the first write queued after its batch). A write that was not in a batch waits on its own event, not
        on the writer's lock: a lock convoy (each of hundreds of threads taking the lock in turn only to find its write
        done, the next batch waiting behind them) took 15 % of a busy control plane's CPU."""
        pending = Pending(op)
        with self.queue_lock:
            self.queue.append(pending)
            lead = not self._leading
            self._leading = True
        if not lead:
            pending.woken.wait()
            if pending.done:
                return pending.result()
        alerts = self._lead()
        if alerts:  # after the commit and outside the lock: a slow hook delays no write
            self.on_alerts(alerts)
        return pending.result()

    def _lead(self) -> list[BudgetAlert]:
        """Commit everything queued (this thread's write among it), then wake those writes and hand the lead on."""
        batch: list[Pending] = []
        try:
            with self.lock:
                with self.queue_lock:
                    batch, self.queue = self.queue, []
                try:
                    return self._commit(batch)
                finally:
                    for p in batch:
                        p.done = True
        finally:
            with self.queue_lock:
                nxt = self.queue[0] if self.queue else None
                self._leading = nxt is not None  # woken not done, `nxt` leads next
            for p in batch:
                p.woken.set()
            if nxt is not None:
                nxt.woken.set()

    def close(self) -> None:
        with self.lock:
            self._drop_connection()

    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn = self.engine.connect()
        return self._conn

    def _drop_connection(self, dead: bool = False) -> None:
        """Close the kept connection; a `dead` one is invalidated, so the pool never hands it out again."""
        if self._conn is not None:
            try:
                if dead:
                    self._conn.invalidate()
                self._conn.close()
            except Exception:
                pass
            self._conn = None

    def _commit(self, batch: list[Pending]) -> list[BudgetAlert]:
        todo = list(batch)
        tries = 0
        while todo:
            for p in todo:
                p.value, p.error = None, None
            writes: WriteBatch | None = None
            try:
                conn = self._connection()
                with self._transaction(conn):
                    writes = WriteBatch(conn, self.sql, self.signer)
                    for p in todo:
                        try:
                            p.value = p.op(writes)
                        except BudgetExceeded as exc:  # a refusal: the batch holds only what stands on its own
                            p.error = exc
                        except Exception as exc:
                            if retryable(exc):  # the database's doing, not the write's: run them all again
                                raise
                            raise _OpFailed(p, exc) from exc
                    writes.flush()
                return writes.alerts
            except _OpFailed as failed:  # rolled back: that write fails alone, the others run again without it
                failed.pending.error = failed.error
                todo.remove(failed.pending)
                self._drop_connection_if_broken()
            except _CommitUnknown as unknown:  # the connection dropped in COMMIT: read back whether it committed
                self._drop_connection(dead=True)
                assert writes is not None
                committed = self._committed(writes)
                if committed:
                    return writes.alerts
                if committed is None or tries >= MAX_RETRIES:
                    err = LedgerUnavailable(described(unknown.error), safe_url(str(self.engine.url)),
                                            unknown=committed is None)
                    for p in todo:
                        p.value, p.error = None, err
                    return []
                tries += 1
                self.retries += 1
                continue
            except Exception as exc:
                self._drop_connection(dead=dropped(exc))
                if retryable(exc) and tries < MAX_RETRIES:
                    tries += 1
                    self.retries += 1
                    time.sleep(random.uniform(0, min(0.2, 0.002 * 2 ** tries)))
                    continue
                if retryable(exc):  # the database's doing, every time: each write hears the cause
                    err = LedgerUnavailable(described(exc), safe_url(str(self.engine.url)))
                    for p in todo:
                        p.value, p.error = None, err
                    return []
                if len(todo) > 1:  # no write owns this failure: run each alone, so only the culprit fails
                    alerts: list[BudgetAlert] = []
                    for p in todo:
                        alerts += self._commit([p])
                    return alerts
                todo[0].value, todo[0].error = None, exc
                return []
            except BaseException as exc:  # interrupted: nothing of this batch is known to have committed
                self._drop_connection()
                for p in todo:
                    p.value, p.error = None, RuntimeError(f"ledger write aborted: {exc!r}")
                raise
        return []

    @contextmanager
    def _transaction(self, conn: Connection) -> Iterator[None]:
        """One transaction on the raw connection (SQLAlchemy's begin and commit cost more than SQLite's).

        An op that executes on `conn` itself joins it: SQLAlchemy autobegins without a statement of
        its own (the SQLite begin hook sees the transaction open), and is then committed through it.
        """
        raw = conn.connection.driver_connection
        if self.sqlite:
            raw.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            try:
                if conn.in_transaction():
                    conn.rollback()
                else:
                    raw.rollback()
            except Exception:  # a dead connection cannot roll back (the server already did): the first error counts
                self._drop_connection(dead=True)
            raise
        try:
            if conn.in_transaction():
                conn.commit()
            else:
                self._commit_raw(raw)
        except Exception as exc:
            if dropped(exc):
                raise _CommitUnknown(exc) from exc
            raise

    @staticmethod
    def _commit_raw(raw: Any) -> None:
        raw.commit()

    def _committed(self, writes: WriteBatch) -> bool | None:
        """Whether a batch whose COMMIT lost its connection was kept: its last record is in the log with its hash.

        A batch that appended no record is taken as not kept (its writes are safe to repeat). None: the log
        could not be read back, after as many tries as a transaction gets."""
        if not writes.evidence:
            return False
        seq, hash_ = writes.head
        for attempt in range(MAX_RETRIES):
            try:
                with self.engine.connect() as conn:
                    found = conn.execute(sa.select(evidence.c.hash).where(evidence.c.seq == seq)).scalar()
                return found == hash_
            except Exception as exc:
                if not retryable(exc):
                    return None
                time.sleep(random.uniform(0, min(0.2, 0.002 * 2 ** (attempt + 1))))
        return None

    def _drop_connection_if_broken(self) -> None:
        conn = self._conn
        if conn is not None and (conn.invalidated or conn.closed):
            self._drop_connection()
