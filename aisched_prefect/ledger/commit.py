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
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy.engine import Connection, Engine

from aisched_prefect.ledger.batch import WriteBatch
from aisched_prefect.ledger.engine import retryable
from aisched_prefect.ledger.records import BudgetAlert, BudgetExceeded
from aisched_prefect.ledger.statements import Statements

MAX_RETRIES = 8


class Pending:
    """One write waiting for its group commit."""

    __slots__ = ("op", "done", "value", "error")

    def __init__(self, op: Callable[[WriteBatch], Any]) -> None:
        self.op, self.done, self.value, self.error = op, False, None, None

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class _OpFailed(Exception):
    """One write raised: roll back, and run the others without it."""

    def __init__(self, pending: Pending, error: Exception) -> None:
        self.pending, self.error = pending, error


class GroupCommit:
    """The write path of one Ledger: a queue, one writer at a time, one connection kept open for it."""

    def __init__(self, engine: Engine, sql: Statements, on_alerts: Callable[[list[BudgetAlert]], None],
                 signer: Callable[[bytes], str] | None = None) -> None:
        self.engine, self.sql, self.on_alerts, self.signer = engine, sql, on_alerts, signer
        self.sqlite = engine.dialect.name == "sqlite"
        self.lock = threading.Lock()
        self.queue: list[Pending] = []
        self.queue_lock = threading.Lock()
        self._conn: Connection | None = None
        self.retries = 0  # transactions run again after a deadlock, serialization failure or lost connection

    def write(self, op: Callable[[WriteBatch], Any]) -> Any:
        pending = Pending(op)
        with self.queue_lock:
            self.queue.append(pending)
        alerts: list[BudgetAlert] = []
        with self.lock:
            if not pending.done:
                with self.queue_lock:
                    batch, self.queue = self.queue, []
                try:
                    alerts = self._commit(batch)
                finally:
                    for p in batch:
                        p.done = True
        if alerts:  # after the commit and outside the lock: a slow hook delays no write
            self.on_alerts(alerts)
        return pending.result()

    def close(self) -> None:
        with self.lock:
            self._drop_connection()

    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn = self.engine.connect()
        return self._conn

    def _drop_connection(self) -> None:
        if self._conn is not None:
            try:
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
            except Exception as exc:
                self._drop_connection()
                if retryable(exc) and tries < MAX_RETRIES:
                    tries += 1
                    self.retries += 1
                    time.sleep(random.uniform(0, min(0.2, 0.002 * 2 ** tries)))
                    continue
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
            if conn.in_transaction():
                conn.rollback()
            else:
                raw.rollback()
            raise
        if conn.in_transaction():
            conn.commit()
        else:
            raw.commit()

    def _drop_connection_if_broken(self) -> None:
        conn = self._conn
        if conn is not None and (conn.invalidated or conn.closed):
            self._drop_connection()
