"""Calls in flight across replicas: each call is claimed by one replica, and taken over if that replica dies.

Several control-plane replicas share one database. A flow's client sends a
call to any of them and, if the replica goes away mid-call, sends the same
call (same key: task run, attempt, admission) to another. The call book makes
that safe: the first replica to claim a key owns it; a replica that finds the
key owned by a live replica answers "busy" (the client waits); one that finds
it owned by a dead replica (no heartbeat for `alive_seconds`) takes it over
and runs the same admission again, with its holds, so a run is admitted once
and settled once whichever replica finishes it.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Literal

import sqlalchemy as sa

from aisched_prefect.errors import AISchedError
from aisched_prefect.ledger import Ledger

ABANDONED = "(abandoned)"  # the replica name of an admitted call its replica gave up: the next to see it takes it over


class CallTakenOver(AISchedError):
    """Another replica took this call over while this one admitted it (its heartbeat stalled); the client retries."""


metadata = sa.MetaData()
calls = sa.Table(
    "aisched_calls", metadata,
    sa.Column("key", sa.String(300), primary_key=True),
    sa.Column("replica", sa.String(200), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),  # running | done
    sa.Column("admission", sa.JSON),
    sa.Column("reply", sa.JSON),
    sa.Column("updated_at", sa.Float, nullable=False),
)
replicas = sa.Table(
    "aisched_replicas", metadata,
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("url", sa.String(300), nullable=False),
    sa.Column("heartbeat", sa.Float, nullable=False),
)

flow_runs = sa.Table(
    "aisched_flow_runs", metadata,
    sa.Column("flow_run_id", sa.String(64), primary_key=True),
    sa.Column("principal", sa.String(200), nullable=False),
)

task_runs = sa.Table(
    "aisched_task_runs", metadata,
    sa.Column("task_run_id", sa.String(64), primary_key=True),
    sa.Column("principal", sa.String(200), nullable=False),
)

Claim = Literal["new", "takeover", "busy", "done"]


def insert_new(conn: Any, table: sa.Table, values: dict[str, Any]) -> bool:
    """Insert a row unless its key is taken (INSERT ... ON CONFLICT DO NOTHING); whether it was inserted.

    No IntegrityError: inside a group commit an error would roll back every other write of the group."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    key = table.primary_key.columns[0]
    return conn.execute(insert(table).values(values).on_conflict_do_nothing().returning(key)).first() is not None


def call_key(who: str, task_run_id: str, attempt: int, admission: str | None = None) -> str:
    """The key a call is claimed and its reply stored under: the caller's identity (authority and principal, as
    `who`), then the task run, attempt and admission the flow sends. Another caller's key is never this one, so a
    stored reply goes back only to the caller that made the call, and nobody can claim a call ahead of its owner."""
    caller = hashlib.sha256(who.encode()).hexdigest()[:24]
    return f"{caller}/{task_run_id}/{attempt}" + (f"/{admission}" if admission else "")


class CallBook:
    def __init__(self, ledger: Ledger, replica: str, url: str, alive_seconds: float = 5.0) -> None:
        self.ledger, self.replica, self.url, self.alive_seconds = ledger, replica, url, alive_seconds
        self._owners: dict[str, str] = {}  # flow run id -> its principal (an owner never changes)
        metadata.create_all(ledger.engine, checkfirst=True)
        self.heartbeat()

    def heartbeat(self) -> None:
        now = time.time()
        with self.ledger.engine.begin() as conn:
            if conn.execute(replicas.update().where(replicas.c.name == self.replica)
                            .values(heartbeat=now, url=self.url)).rowcount == 0:
                conn.execute(replicas.insert().values(name=self.replica, url=self.url, heartbeat=now))

    def alive(self, replica: str) -> bool:
        with self.ledger.reader.connect() as conn:
            beat = conn.execute(sa.select(replicas.c.heartbeat).where(replicas.c.name == replica)).scalar()
        return beat is not None and time.time() - beat < self.alive_seconds

    def owner(self, flow_run_id: str, principal: str) -> str:
        """The principal a flow run belongs to: the first to call under its id. Another principal filing calls (and
        so evidence) under someone else's flow run is refused by the caller of this."""
        known = self._owners.get(flow_run_id)
        if known is not None:
            return known
        if len(self._owners) > 10_000:
            self._owners.clear()
        self._owners[flow_run_id] = owner = self._owner(flow_run_id, principal)
        return owner

    def owner_of(self, flow_run_id: str) -> str | None:
        """Who made calls under this flow run, or None."""
        known = self._owners.get(flow_run_id)
        if known is not None:
            return known
        with self.ledger.reader.connect() as conn:
            return conn.execute(sa.select(flow_runs.c.principal).where(flow_runs.c.flow_run_id == flow_run_id)).scalar()

    def task_owner(self, task_run_id: str, principal: str) -> str:
        """The caller a task run id belongs to: the first to call under it (the ids are readable in Prefect, so
        another tenant can send one). The caller of this refuses a call under a task run another principal used."""
        key = f"task:{task_run_id}"
        known = self._owners.get(key)
        if known is not None:
            return known
        if len(self._owners) > 10_000:
            self._owners.clear()
        self._owners[key] = owner = self._first(task_runs, task_runs.c.task_run_id, task_run_id, principal)
        return owner

    def _first(self, table: sa.Table, column: Any, value: str, principal: str) -> str:
        """The principal of `value` in `table`: `principal`, if this call is the first to file it (group-committed
        with other runs' writes: a .map()'s shards file thousands of them)."""
        if self.ledger.write(lambda conn: insert_new(conn, table, {column.name: value, "principal": principal})):
            return principal
        with self.ledger.reader.connect() as conn:
            return conn.execute(sa.select(table.c.principal).where(column == value)).scalar_one()

    def _owner(self, flow_run_id: str, principal: str) -> str:
        return self._first(flow_runs, flow_runs.c.flow_run_id, flow_run_id, principal)

    def claim(self, key: str) -> tuple[Claim, Any]:
        """Own `key`: new, taken over from a dead replica, busy on a live one, or already done."""
        now = time.time()
        row = {"key": key, "replica": self.replica, "status": "running", "admission": None, "reply": None,
               "updated_at": now}
        if self.ledger.write(lambda conn: insert_new(conn, calls, row)):
            return "new", None
        with self.ledger.reader.connect() as conn:
            row = conn.execute(sa.select(calls).where(calls.c.key == key)).first()
        if row is None:  # removed meanwhile: try once more
            return self.claim(key)
        if row.status == "done":
            return "done", row
        if row.replica == self.replica or self.alive(row.replica):
            return "busy", row
        with self.ledger.engine.begin() as conn:
            taken = conn.execute(calls.update().where((calls.c.key == key) & (calls.c.replica == row.replica)
                                                      & (calls.c.status == "running"))
                                 .values(replica=self.replica, updated_at=now)).rowcount
        return ("takeover" if taken == 1 else "busy"), row

    def admitted(self, key: str, admission: dict[str, Any], conn: Any = None) -> None:
        """The call's admission, for a replica that takes it over; `conn`: in the transaction that holds its budget,
        so a replica killed right after the holds were taken leaves them found, not held twice. Raises CallTakenOver
        (rolling that transaction back) if another replica took the call over meanwhile (this one's heartbeat
        stalled): only one of them holds budget for it."""
        if conn is None:
            with self.ledger.engine.begin() as conn:
                self.admitted(key, admission, conn)
            return
        mine = (calls.c.key == key) & (calls.c.replica == self.replica) & (calls.c.status == "running")
        if conn.execute(calls.update().where(mine).values(admission=admission, updated_at=time.time())).rowcount != 1:
            raise CallTakenOver(f"call {key} was taken over by another replica")

    def done(self, key: str, reply: dict[str, Any]) -> None:
        now = time.time()
        self.ledger.write(lambda conn: conn.execute(calls.update().where(calls.c.key == key)
                                                    .values(status="done", reply=reply, updated_at=now)))

    def release(self, key: str) -> None:
        """A claim whose call failed here: forgotten if nothing was decided (bad input), so the client may send it
        again; left for a takeover if it was admitted (its holds are filed with it), so the retry continues that
        admission on whichever replica it reaches, never holding budget twice."""
        mine = (calls.c.key == key) & (calls.c.replica == self.replica) & (calls.c.status == "running")
        with self.ledger.engine.begin() as conn:
            row = conn.execute(sa.select(calls.c.admission).where(mine)).first()
            if row is None:
                return
            if row.admission is None:  # (stored as JSON null: compared here, not in SQL)
                conn.execute(calls.delete().where(mine))
            else:
                conn.execute(calls.update().where(mine).values(replica=ABANDONED, updated_at=time.time()))
