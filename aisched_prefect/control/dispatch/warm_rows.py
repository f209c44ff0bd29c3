"""A warm body's life as rows in the ledger's database (`aisched_warm_bodies`), as a run's is.

Why rows: a warm body outlives its run, holds a device share and money, and acts under its run's authority; a plane
that kept it only in memory forgot it when it was killed and started again (its revocations reached nothing, its
idle holds expired charged in full) and a replica never knew it. One row per body: started cold by a run, idle with
the hold of its idle period (`runs` names the period), taken by the next run of its key, ended and why. A row only
moves forward (idle -> running -> idle ... -> ended, each move conditional on the state it leaves), so two replicas
that both see an end move it once; the money is settled once by the ledger (settling a hold twice changes nothing).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from aisched_prefect.control.admission.record import Admission
from aisched_prefect.ledger import Hold, Ledger
from aisched_prefect.ledger.schema import warm_bodies as table
from aisched_prefect.ledger.statements import built_once, dialect_insert


@dataclass(frozen=True)
class IdleRow:
    """An idle body as its row says: enough to settle, renew or end it from any replica."""

    body: str
    runs: int
    admission: Admission
    holds: list[Hold]
    keep: float
    gpu_type: str | None
    worker: str
    idle_since: float  # the plane's clock (time.time()): when its last wait began
    before: float = 0.0  # carried on by back-to-back runs: the earlier waits' seconds
    waits: tuple[tuple[str, float], ...] = ()  # ... each: the admission of the run that ended it, its seconds


def _upsert(conn: Any, values: dict[str, Any], later_only: bool = False) -> None:
    """Write a body's one row. `later_only`: never over a later idle period's (two runs of one body settle on two
    threads, and the earlier period's row written last would hide the later one from a restarted plane's books).
    The statement is built once per (dialect, columns, later_only) and run with each row's values
    (ledger.statements.built_once)."""
    dialect, columns = conn.dialect.name, tuple(values)

    def build() -> Any:
        new = dialect_insert(dialect)(table)
        return new.on_conflict_do_update(index_elements=[table.c.body],
                                         set_={k: new.excluded[k] for k in columns if k not in ("body", "started_at")},
                                         where=(table.c.runs <= new.excluded.runs) if later_only else None)

    conn.execute(built_once(("warm body upsert", dialect, columns, later_only), build), values)


_LEAVE_IDLE = (table.update().where((table.c.body == sa.bindparam("b_body")) & (table.c.runs == sa.bindparam("b_runs"))
                                    & (table.c.state == "idle")))
_CARRY = _LEAVE_IDLE  # the same row, still idle under the same period, moved on to the run that carried it


class CarriedOn(Exception):
    """An idle period's end came from a word about it as it was: a later run of its key carried it on under the
    same hold (another replica's books, or this plane's), so settling it now would settle a period still running."""


_ROW = sa.select(table.c.state, table.c.runs, table.c.holds).where(table.c.body == sa.bindparam("b_body"))


class BodyRows:
    """Reads and moves the rows; every write is one statement in the ledger's group commit."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def idle(self, body: str, runs: int, adm: Admission, holds: list[Hold], keep: float, gpu_type: str | None,
             worker: str, key: str, since: float, started_at: float) -> None:
        """The body waits for the next run of its key: its idle period `runs` and its hold (a cold body's row is
        made here: the plane hears of a body with its first run's outcome)."""
        self.ledger.write(lambda conn: self.idle_op(body, runs, adm, keep, gpu_type, worker, key, since,
                                                    started_at)(conn, holds))

    @staticmethod
    def idle_op(body: str, runs: int, adm: Admission, keep: float, gpu_type: str | None, worker: str, key: str,
                since: float, started_at: float) -> Callable[[Any, list[Hold]], None]:
        """`idle` as a write on a transaction's connection, given the holds it is written with (the idle hold's
        own transaction: control.dispatch.warm, so a hold never stands without its row, nor a row without its
        hold)."""
        def op(conn: Any, holds: list[Hold]) -> None:
            values = {"body": body, "key": key, "tenant": adm.tenant, "principal": adm.principal, "worker": worker,
                      "state": "idle", "runs": runs, "admission": adm.model_dump(mode="json"),
                      "holds": [h.model_dump(mode="json") for h in holds], "keep_seconds": keep,
                      "gpu_type": gpu_type, "started_at": started_at, "idle_since": since, "idle_before": 0.0,
                      "waits": None, "ended_at": None, "ended_why": None, "updated_at": time.time()}
            _upsert(conn, values, later_only=True)

        return op

    def carry(self, body: str, runs: int, to_runs: int, adm: Admission, since: float, before: float,
              waits: list[tuple[str, float]]) -> bool:
        """Its idle period `runs` carried on by run `to_runs` of its key, which left it warm again: the row names
        that run, its admission (its authority now) and the waits so far. Whether this moved it (False: the period
        ended meanwhile, its row moved by whoever ended it)."""
        values = {"b_body": body, "b_runs": runs, "runs": to_runs, "admission": adm.model_dump(mode="json"),
                  "idle_since": since, "idle_before": before, "waits": [list(w) for w in waits],
                  "updated_at": time.time()}
        return bool(self.ledger.write(lambda conn: conn.execute(_CARRY, values).rowcount))

    def ended_cold(self, body: str, adm: Admission, worker: str, key: str, why: str, started_at: float) -> None:
        """A body that ended with its run, or was never held idle (its idle time not covered)."""
        now = time.time()
        values = {"body": body, "key": key, "tenant": adm.tenant, "principal": adm.principal, "worker": worker,
                  "state": "ended", "runs": 0, "admission": None, "holds": None, "keep_seconds": 0.0,
                  "gpu_type": None, "started_at": started_at, "idle_since": None, "ended_at": now, "ended_why": why,
                  "updated_at": now}
        self.ledger.write(lambda conn: _upsert(conn, values))

    def left_idle(self, body: str, runs: int, *, taken: bool, why: str, at: float | None = None) -> bool:
        """Its idle period `runs` ended: taken by a run of its key (`taken`), or the body ended (`why`). Whether this
        call moved the row (False: another replica did, or the row never said idle)."""
        return bool(self.ledger.write(self.left_idle_op(body, runs, taken=taken, why=why, at=at)))

    @staticmethod
    def left_idle_op(body: str, runs: int, *, taken: bool, why: str, at: float | None = None,
                     holds: list[str] | None = None) -> Callable[[Any], bool]:
        """`left_idle` as a write on a transaction's connection (the idle hold's settlement's own: one write).
        `holds`: the period's hold ids; a row still idle under them at a later run count was carried on, and the
        write raises CarriedOn (rolling the settlement back) rather than settle it."""
        at = time.time() if at is None else at
        values: dict[str, Any] = ({"state": "running", "taken_at": at, "updated_at": time.time()} if taken else
                                  {"state": "ended", "ended_at": at, "ended_why": why[:2000], "updated_at": time.time()})

        def op(conn: Any) -> bool:
            done = conn.execute(_LEAVE_IDLE, {"b_body": body, "b_runs": runs, **values})
            if not done.rowcount and holds is not None:
                row = conn.execute(_ROW, {"b_body": body}).first()
                if (row is not None and row.state == "idle" and row.runs > runs
                        and sorted(h.get("id") for h in row.holds or []) == sorted(holds)):
                    raise CarriedOn(f"warm body {body}'s idle period {runs} was carried on to run {row.runs}")
            return bool(done.rowcount)

        return op

    def load_idle(self, body: str | None = None, runs: int | None = None) -> list[IdleRow]:
        """The idle bodies (or the one idle period `body`, `runs`), whoever booked them."""
        query = sa.select(table).where(table.c.state == "idle")
        if body is not None:
            query = query.where(table.c.body == body)
        if runs is not None:
            query = query.where(table.c.runs == runs)
        with self.ledger.reader.connect() as conn:
            rows = conn.execute(query).all()
        return [IdleRow(r.body, int(r.runs), Admission.model_validate(r.admission),
                        [Hold.model_validate(h) for h in r.holds or []], float(r.keep_seconds), r.gpu_type, r.worker,
                        float(r.idle_since or 0.0), float(r.idle_before or 0.0),
                        tuple((str(a), float(x)) for a, x in r.waits or ())) for r in rows if r.admission]

    def row(self, body: str) -> dict[str, Any] | None:
        """One body's row as it is (reports, tests)."""
        with self.ledger.reader.connect() as conn:
            r = conn.execute(sa.select(table).where(table.c.body == body)).first()
        return None if r is None else dict(r._mapping)
