"""Where the ledger lives and how it is reached: its URL, its engines, the database's clock, and which errors to retry."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

LEDGER_URL_ENV = "AISCHED_LEDGER_URL"
HOME_ENV = "AISCHED_HOME"


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

        begin = "BEGIN IMMEDIATE" if for_writes else "BEGIN"

        @sa.event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Connection) -> None:
            raw = conn.connection.driver_connection
            if not raw.in_transaction:  # the group commit may have begun it on the raw connection already
                raw.execute(begin)

        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://"):]
    return sa.create_engine(url, pool_pre_ping=True, pool_size=8, max_overflow=16)


def clock(dialect: sa.engine.Dialect) -> Any:
    """The database's own clock as Unix seconds, a column expression.

    Leases and rolling windows are measured by it, so hosts whose clocks
    disagree still agree on when a lease ran out. Postgres: the transaction's
    start (`now()`); SQLite: its own reading of the time ('now').
    """
    if dialect.name == "postgresql":
        return sa.literal_column("CAST(EXTRACT(EPOCH FROM now()) AS DOUBLE PRECISION)")
    if dialect.name == "sqlite":
        return sa.literal_column("((julianday('now') - 2440587.5) * 86400.0)")
    raise NotImplementedError(f"the ledger runs on SQLite or Postgres, not {dialect.name}")


RETRY_SQLSTATES = {"40001", "40P01"}  # serialization failure, deadlock detected
# The server ended the session (pg_terminate_backend, a restart, a failover): the connection is gone.
DROPPED_SQLSTATES = {"57P01", "57P02", "57P03"}  # admin shutdown, crash shutdown, cannot connect now


def _driver_error(exc: BaseException) -> BaseException:
    """The driver's own exception: the write path runs on the raw DBAPI cursor, so it is not always wrapped."""
    return exc.orig if isinstance(exc, sa.exc.DBAPIError) and exc.orig is not None else exc


def dropped(exc: BaseException) -> bool:
    """The connection is gone (the server ended it, or the network did): discard it and run the work again.

    Recognised whether SQLAlchemy wrapped the error or psycopg raised it from the raw cursor (or from
    `rollback()` on the dead connection): a psycopg OperationalError of a connection class (08, 57P0x) or with
    no SQLSTATE at all (the client noticed the socket closed), or an InterfaceError on a closed connection.
    """
    if isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated:
        return True
    orig = _driver_error(exc)
    try:
        import psycopg
    except ImportError:  # pragma: no cover - SQLite-only installs
        return False
    if isinstance(orig, psycopg.OperationalError):
        state = getattr(orig, "sqlstate", None)
        return state is None or state.startswith("08") or state in DROPPED_SQLSTATES
    return isinstance(orig, psycopg.InterfaceError) and "closed" in str(orig)


def retryable(exc: BaseException) -> bool:
    """A failure that says nothing about the writes themselves: run them again."""
    if dropped(exc):
        return True
    orig = _driver_error(exc)
    if getattr(orig, "sqlstate", None) in RETRY_SQLSTATES:
        return True
    if isinstance(orig, sqlite3.OperationalError) and ("locked" in str(orig) or "busy" in str(orig)):
        return True
    return False


def described(exc: BaseException) -> str:
    """The cause of a database failure in one line: the driver's class and first line of its message."""
    orig = _driver_error(exc)
    first = (str(orig).strip().splitlines() or [""])[0]
    return f"{type(orig).__name__}: {first}" if first else type(orig).__name__


def safe_url(url: str) -> str:
    """The URL without its password, for messages."""
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url.split("@")[-1]


def database_errors() -> tuple[type[BaseException], ...]:
    """The exception classes a database failure arrives as: SQLAlchemy's, and the drivers' own (raw cursors)."""
    out: list[type[BaseException]] = [sa.exc.DBAPIError, sqlite3.Error]
    try:
        import psycopg

        out.append(psycopg.Error)
    except ImportError:  # pragma: no cover - SQLite-only installs
        pass
    return tuple(out)
