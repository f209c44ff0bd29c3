"""Calls in flight across replicas: each call is claimed by one replica, and taken over if that replica dies.

Several control-plane replicas share one database. A flow's client sends a
call to any of them and, if the replica goes away mid-call, sends the same
call (same key: task run, attempt, admission) to another. The call book makes
that safe: the first replica to claim a key owns it; a replica that finds the
key owned by a live replica answers "busy" (the client waits); one that finds
it owned by a dead replica (no heartbeat for `alive_seconds`) takes it over
and runs the same admission again, with its holds, so a run is admitted once
and settled once whichever replica finishes it.

A completed call's reply is kept here so that a flow re-attaching after a
replica died or restarted gets it. A reply whose large result stays on its
worker (dask_gpu.worker.results) names it with a one-time token, which is a
capability: whoever holds it can take the result first. The book keeps the
digest, size, URL and expiry in clear and the token only sealed (AES-256-GCM
under a key derived from the plane's signing key, which lives in its key file,
not in the database; the call's key is the associated data, so a sealed token
opens only for the call it was sealed for). A row read from the database alone
gives no token.
"""

from __future__ import annotations

import base64
import hashlib
import os
import time
from typing import Any, Literal

import sqlalchemy as sa
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from aisched_prefect.control.authority.credentials import Unauthorized
from aisched_prefect.errors import AISchedError
from aisched_prefect.ledger import Ledger
from aisched_prefect.ledger.statements import built_once, dialect_insert

KEEP_RESULT_BYTES = 256 * 1024  # an inline result (or error) this small is kept, sealed, with the call's reply
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
    dialect = conn.dialect.name
    stmt = built_once(("insert new", dialect, table.name, tuple(values)), lambda: dialect_insert(dialect)(table)
                      .on_conflict_do_nothing().returning(table.primary_key.columns[0]))
    return conn.execute(stmt, values).first() is not None


def _first_filed(conn: Any, table: sa.Table, column: Any, value: str, principal: str) -> str:
    """The principal `value` is filed under in `table`: `principal` if this transaction files it first."""
    if insert_new(conn, table, {column.name: value, "principal": principal}):
        return principal
    stmt = built_once(("principal of", table.name),
                      lambda: sa.select(table.c.principal).where(column == sa.bindparam("b_v")))
    return conn.execute(stmt, {"b_v": value}).scalar_one()


# The call book's per-shard UPDATEs, built once (ledger.statements.built_once says why) and run with bound values.
_MINE = calls.update().where((calls.c.key == sa.bindparam("b_key")) & (calls.c.replica == sa.bindparam("b_replica"))
                             & (calls.c.status == "running"))
_BY_KEY = calls.update().where(calls.c.key == sa.bindparam("b_key"))


def _task_key(task_run_id: str) -> str:
    return f"task:{task_run_id}"


def _not_callers_task_run(task_run_id: str) -> Unauthorized:
    return Unauthorized(f"task run {task_run_id} belongs to another principal: a flow files its calls under its own "
                        "task runs", 403)


def _caller(who: str) -> str:
    return hashlib.sha256(who.encode()).hexdigest()[:24]


def callers_key(who: str, key: str) -> bool:
    """Whether call `key` was made by `who` (its first part names the caller)."""
    return key.startswith(_caller(who) + "/")


def call_key(who: str, task_run_id: str, attempt: int, admission: str | None = None) -> str:
    """The key a call is claimed and its reply stored under: the caller's identity (authority and principal, as
    `who`), then the task run, attempt and admission the flow sends. Another caller's key is never this one, so a
    stored reply goes back only to the caller that made the call, and nobody can claim a call ahead of its owner."""
    return f"{_caller(who)}/{task_run_id}/{attempt}" + (f"/{admission}" if admission else "")


TOKEN_PURPOSE = "call-book/result-tokens/1"  # what the sealing key is derived for (keys.derived_secret)


class TokenSeal:
    """Seals a result token for the call book: AES-256-GCM, a random nonce each time, the call's key as associated
    data (a sealed token copied into another call's row does not open).

    >>> seal = TokenSeal(bytes(32))
    >>> sealed = seal.seal("k1", "secret-token")
    >>> "secret" in sealed, seal.open("k1", sealed), seal.open("k2", sealed), TokenSeal(b"x" * 32).open("k1", sealed)
    (False, 'secret-token', None, None)
    """

    PREFIX = "aesgcm1:"

    def __init__(self, secret: bytes) -> None:
        self._aead = AESGCM(secret)

    def seal(self, call: str, token: str) -> str:
        nonce = os.urandom(12)
        return self.PREFIX + base64.urlsafe_b64encode(nonce + self._aead.encrypt(nonce, token.encode(), call.encode())
                                                      ).decode()

    def open(self, call: str, sealed: str) -> str | None:
        """The token, or None: not sealed by this key, or sealed for another call, or altered."""
        if not sealed.startswith(self.PREFIX):
            return None
        try:
            raw = base64.urlsafe_b64decode(sealed[len(self.PREFIX):])
            return self._aead.decrypt(raw[:12], raw[12:], call.encode()).decode()
        except (ValueError, InvalidTag, UnicodeDecodeError):
            return None


class CallBook:
    def __init__(self, ledger: Ledger, replica: str, url: str, alive_seconds: float = 5.0,
                 seal: TokenSeal | None = None) -> None:
        """`seal`: how result tokens are kept (None: not at all; a completed call re-attached to then finds its
        large result lost, and is told why)."""
        self.ledger, self.replica, self.url, self.alive_seconds = ledger, replica, url, alive_seconds
        self.seal = seal
        self._owners: dict[str, str] = {}  # flow run id -> its principal (an owner never changes)
        metadata.create_all(ledger.engine, checkfirst=True)
        self.heartbeat()
        self.seal_clear_tokens()

    # -- result tokens -------------------------------------------------------------------------------
    def _stored(self, key: str, reply: dict[str, Any]) -> dict[str, Any]:
        """What the book keeps of `reply`: its result's token sealed (or left out), everything else as it is."""
        ref = reply.get("result_ref")
        if not isinstance(ref, dict) or "token" not in ref:
            return reply
        ref = dict(ref)
        token = ref.pop("token")
        if self.seal is not None and isinstance(token, str):
            ref["sealed_token"] = self.seal.seal(key, token)
        return {**reply, "result_ref": ref}

    def out(self, key: str, stored: dict[str, Any]) -> bytes | None:
        """The bytes a done call's reply travelled with, as `done` kept them (None: not kept, or not opened)."""
        sealed = stored.get("sealed_out")
        opened = self.seal.open(f"{key}#out", sealed) if self.seal is not None and isinstance(sealed, str) else None
        return base64.b64decode(opened) if opened is not None else None

    def reply(self, key: str, stored: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """A done call's reply as it was sent, its result token opened; if it cannot be, the reply without its result
        reference and why (for a ResultLost the caller names)."""
        stored = {k: v for k, v in stored.items() if k != "sealed_out"}
        ref = stored.get("result_ref")
        if not isinstance(ref, dict):
            return stored, ""
        ref = dict(ref)
        sealed = ref.pop("sealed_token", None)
        ref.pop("token", None)  # a row written in clear by an older plane: never trusted or handed on
        token = self.seal.open(key, sealed) if self.seal is not None and isinstance(sealed, str) else None
        if token is None:
            if not isinstance(sealed, str):
                why = "the call book keeps no token for it (it was filed without one)"
            elif self.seal is None:
                why = "this control plane has no key to open the token the call book keeps sealed"
            else:
                why = ("its sealed token does not open with this control plane's key (the key file was replaced, or "
                       "the row was altered)")
            return {k: v for k, v in stored.items() if k != "result_ref"}, why
        return {**stored, "result_ref": {**ref, "token": token}}, ""

    def seal_clear_tokens(self) -> int:
        """Rows an older plane wrote with a result token in clear: sealed (or stripped) now; how many."""
        clear = sa.cast(calls.c.reply, sa.Text).like('%"token"%')
        with self.ledger.reader.connect() as conn:
            rows = conn.execute(sa.select(calls.c.key, calls.c.reply).where((calls.c.status == "done") & clear)).all()
        fixed = 0
        for row in rows:
            if isinstance(row.reply, dict) and isinstance(row.reply.get("result_ref"), dict) \
                    and "token" in row.reply["result_ref"]:
                stored = self._stored(row.key, row.reply)
                with self.ledger.engine.begin() as conn:
                    conn.execute(calls.update().where(calls.c.key == row.key).values(reply=stored))
                fixed += 1
        return fixed

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
        return self._remember(flow_run_id, self._owner(flow_run_id, principal))

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
        known = self._owners.get(_task_key(task_run_id))
        if known is not None:
            return known
        return self._remember(_task_key(task_run_id),
                              self._first(task_runs, task_runs.c.task_run_id, task_run_id, principal))

    def _remember(self, key: str, owner: str) -> str:
        """Keep who a flow run or task run belongs to (a bounded cache: it never changes once filed)."""
        if len(self._owners) > 10_000:
            self._owners.clear()
        self._owners[key] = owner
        return owner

    def check_caller(self, flow_run_id: str, task_run_id: str, caller: str) -> None:
        """Refuse a call filed under a flow run or a task run another principal called under first: its evidence and
        its replies are that principal's."""
        self._check_flow_run(flow_run_id, caller)
        if self.task_owner(task_run_id, caller) != caller:
            raise _not_callers_task_run(task_run_id)

    def _check_flow_run(self, flow_run_id: str, caller: str) -> None:
        owner = self.owner(flow_run_id, caller)
        if owner != caller:
            raise Unauthorized(f"flow run {flow_run_id} belongs to {owner!r}: a flow files its calls under its own flow "
                               "run", 403)

    def _first(self, table: sa.Table, column: Any, value: str, principal: str) -> str:
        """The principal of `value` in `table`: `principal`, if this call is the first to file it (group-committed
        with other runs' writes: a .map()'s shards file thousands of them)."""
        return self.ledger.write(lambda conn: _first_filed(conn, table, column, value, principal))

    def _owner(self, flow_run_id: str, principal: str) -> str:
        return self._first(flow_runs, flow_runs.c.flow_run_id, flow_run_id, principal)

    def get(self, key: str) -> Any:
        """The call's row, or None."""
        with self.ledger.reader.connect() as conn:
            return conn.execute(sa.select(calls).where(calls.c.key == key)).first()

    def claim(self, key: str) -> tuple[Claim, Any]:
        """Own `key`: new, taken over from a dead replica, busy on a live one, or already done."""
        if self.ledger.write(lambda conn: insert_new(conn, calls, self._new_row(key))):
            return "new", None
        return self._claimed(key)

    def _new_row(self, key: str) -> dict[str, Any]:
        return {"key": key, "replica": self.replica, "status": "running", "admission": None, "reply": None,
                "updated_at": time.time()}

    def check_and_claim(self, flow_run_id: str, task_run_id: str, caller: str, key: str) -> tuple[Claim, Any]:
        """`check_caller`, then `claim`, in one write for a task run seen first (each shard of a .map() is one): its
        owner filed and the call claimed in the same transaction, the claim only if the task run is the caller's."""
        if _task_key(task_run_id) in self._owners:
            self.check_caller(flow_run_id, task_run_id, caller)
            return self.claim(key)
        self._check_flow_run(flow_run_id, caller)
        row = self._new_row(key)

        def op(conn: Any) -> tuple[str, bool]:
            first = _first_filed(conn, task_runs, task_runs.c.task_run_id, task_run_id, caller)
            return first, first == caller and insert_new(conn, calls, row)

        first, new = self.ledger.write(op)
        if self._remember(_task_key(task_run_id), first) != caller:
            raise _not_callers_task_run(task_run_id)
        return ("new", None) if new else self._claimed(key)

    def _claimed(self, key: str) -> tuple[Claim, Any]:
        """`key` was filed before this claim: done, busy on a live replica, or taken over from a dead one."""
        now = time.time()
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
        if conn.execute(_MINE, {"b_key": key, "b_replica": self.replica, "admission": admission,
                                "updated_at": time.time()}).rowcount != 1:
            raise CallTakenOver(f"call {key} was taken over by another replica")

    def done(self, key: str, reply: dict[str, Any], out: bytes = b"") -> None:
        """File a call's reply (its result token sealed: `_stored`), and `out` (the bytes the reply travels with: its
        inline result, or its error) sealed beside it when it is at most KEEP_RESULT_BYTES. Why: a plane that restarts
        between a run's end and its flow's poll loses the bytes it held in memory; the flow sends the call again
        and gets them from here instead of a ResultLost for a run that finished."""
        now = time.time()
        reply = self._stored(key, reply)
        if self.seal is not None and 0 < len(out) <= KEEP_RESULT_BYTES:
            reply = {**reply, "sealed_out": self.seal.seal(f"{key}#out", base64.b64encode(out).decode())}
        self.ledger.write(lambda conn: conn.execute(_BY_KEY, {"b_key": key, "status": "done", "reply": reply,
                                                              "updated_at": now}))

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
