"""Ledger throughput: reserve+settle pairs per second, beside a raw driver loop doing the same writes.

Each pair is what one admitted AI task costs the ledger: a hold on its budget
with its admission evidence (one transaction), then the settlement with its
evidence (another). The raw loop is the floor under that: the same rows
written with the bare driver (`sqlite3`, `psycopg`), in the same two
transactions, reading and updating the chain head and the account, inserting
the hold and two hash-chained evidence records, with nothing else (no checks,
no group commit, no models). A client is a separate process with its own
Ledger (`--mode processes`, as flow runs on several hosts are), or a thread of
one process sharing one Ledger (`--mode threads`, as the tasks of one flow run
are; their writes are group-committed; the raw loop then runs in one thread).

    make bench-ledger     # or: .venv/bin/python bench/ledger.py --seconds 5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import tempfile
import threading
import time
import uuid
from typing import Any

TARGET_RATIO = 0.5  # the ledger's pairs/s against the raw loop's, one client
POSTGRES = os.environ.get("AISCHED_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
HOLD_COLUMNS = ("id", "budget", "period", "flow_run_id", "task_run_id", "principal", "reserved_micros", "charged_micros",
                "status", "created_at", "settled_at", "unit", "lease_until", "group_id", "reserved_seq")
EVIDENCE_COLUMNS = ("seq", "ts", "kind", "flow_run_id", "task_run_id", "principal", "payload", "prev_hash", "hash")


def _pairs(url: str, seconds: float, threads: int, ready: Any = None, go: Any = None) -> int:
    """Reserve+settle through the Ledger as fast as possible for `seconds` once `go` is set; returns pairs done."""
    from aisched_prefect.ledger import Ledger
    from blocks import BudgetLine

    ledger = Ledger(url)
    line = BudgetLine(budget="bench", period="total", limit=1e12, amount=1.0)
    done = [0] * threads
    if ready is not None:  # every client imported and connected before anyone starts the clock
        ready.put(1)
        go.wait()
    deadline = time.time() + seconds

    def loop(i: int) -> None:
        ids = {"flow_run_id": "bench", "task_run_id": f"t{i}", "principal": "bench"}
        while time.time() < deadline:
            (hold,), _ = ledger.reserve([line], kind="admission", payload={"task": "bench"}, **ids)
            ledger.settle([hold.id], 0.5, kind="settlement", payload={"task": "bench"}, **ids)
            done[i] += 1

    pool = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    ledger.close()
    return sum(done)


class _Raw:
    """The same writes as one reserve+settle pair, with the bare driver."""

    def __init__(self, url: str) -> None:
        self.sqlite = url.startswith("sqlite")
        if self.sqlite:
            import sqlite3

            self.conn = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None, timeout=60)
            for pragma in ("busy_timeout=60000", "journal_mode=WAL", "synchronous=NORMAL"):
                self.conn.execute(f"PRAGMA {pragma}")
            self.p, self.begin, self.lock = "?", "BEGIN IMMEDIATE", ""
        else:
            import psycopg

            self.conn = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"))
            self.p, self.begin, self.lock = "%s", None, " FOR UPDATE"
        p = self.p
        self.head_sql = f"SELECT seq, hash FROM aisched_chain_head WHERE id = 1{self.lock}"
        self.head_update = f"UPDATE aisched_chain_head SET seq = {p}, hash = {p} WHERE id = 1"
        self.account_sql = (f"SELECT limit_micros, pending_micros, posted_micros FROM aisched_budget_accounts "
                            f"WHERE budget = {p} AND period = {p}{self.lock}")
        self.account_update = (f"UPDATE aisched_budget_accounts SET pending_micros = {p}, posted_micros = {p} "
                               f"WHERE budget = {p} AND period = {p}")
        self.hold_insert = f"INSERT INTO aisched_holds ({', '.join(HOLD_COLUMNS)}) VALUES ({', '.join([p] * len(HOLD_COLUMNS))})"
        self.hold_sql = f"SELECT reserved_micros, status FROM aisched_holds WHERE id = {p}{self.lock}"
        self.hold_update = f"UPDATE aisched_holds SET status = {p}, charged_micros = {p}, settled_at = {p} WHERE id = {p}"
        self.evidence_insert = (f"INSERT INTO aisched_evidence ({', '.join(EVIDENCE_COLUMNS)}) "
                                f"VALUES ({', '.join([p] * len(EVIDENCE_COLUMNS))})")
        cur = self.conn.cursor()
        if self.begin:
            cur.execute(self.begin)
        cur.execute(f"INSERT INTO aisched_budget_accounts (budget, period, limit_micros, pending_micros, posted_micros, "
                    f"unit, alerted, carry_femtos) VALUES ({', '.join([p] * 8)})",
                    ("bench", "total", 10**18, 0, 0, "money", 0, 0))
        self.conn.commit() if not self.sqlite else cur.execute("COMMIT")

    def _append(self, cur: Any, head: tuple[int, str], kind: str, payload: dict[str, Any], ids: dict[str, Any]) -> None:
        seq, prev = head[0] + 1, head[1]
        ts = time.time()
        body = {"seq": seq, "ts": repr(ts), "kind": kind, **ids, "payload": payload}
        digest = hashlib.sha256(prev.encode() + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        cur.execute(self.evidence_insert, (seq, ts, kind, ids["flow_run_id"], ids["task_run_id"], ids["principal"],
                                           json.dumps(payload), prev, digest))
        cur.execute(self.head_update, (seq, digest))

    def _transaction(self, work: Any) -> None:
        cur = self.conn.cursor()
        if self.begin:
            cur.execute(self.begin)
        work(cur)
        if self.sqlite:
            cur.execute("COMMIT")
        else:
            self.conn.commit()

    def pair(self, ids: dict[str, Any]) -> None:
        """One reservation and its settlement, with the evidence payloads the ledger writes."""
        hold_id = str(uuid.uuid4())

        def reserve(cur: Any) -> None:
            head = cur.execute(self.head_sql).fetchone()  # the lock order: head, account, hold
            limit, pending, posted = cur.execute(self.account_sql, ("bench", "total")).fetchone()
            now = time.time()
            cur.execute(self.hold_insert, (hold_id, "bench", "total", ids["flow_run_id"], ids["task_run_id"],
                                           ids["principal"], 1_000_000, None, "pending", now, None, "money", now + 300,
                                           hold_id, head[0] + 1))
            cur.execute(self.account_update, (pending + 1_000_000, posted, "bench", "total"))
            free = (limit - pending - posted) / 1e6
            self._append(cur, head, "admission", {"task": "bench", "holds": [
                {"id": hold_id, "budget": "bench", "period": "total", "reserved": 1.0, "remaining_before": free,
                 "remaining_after": free - 1.0, "unit": "money", "group": hold_id}]}, ids)

        def settle(cur: Any) -> None:
            head = cur.execute(self.head_sql).fetchone()
            reserved, _ = cur.execute(self.hold_sql, (hold_id,)).fetchone()
            limit, pending, posted = cur.execute(self.account_sql, ("bench", "total")).fetchone()
            cur.execute(self.hold_update, ("posted", 500_000, time.time(), hold_id))
            cur.execute(self.account_update, (pending - reserved, posted + 500_000, "bench", "total"))
            self._append(cur, head, "settlement", {"task": "bench", "settlements": [
                {"hold_id": hold_id, "charged": 0.5, "released": 0.5, "uncovered": 0.0, "status": "posted",
                 "first": True, "budget": "bench", "unit": "money"}]}, ids)

        self._transaction(reserve)
        self._transaction(settle)


def _raw_pairs(url: str, seconds: float) -> int:
    """The raw loop, one client, for `seconds`; returns pairs done."""
    raw = _Raw(url)
    ids = {"flow_run_id": "bench", "task_run_id": "t0", "principal": "bench"}
    deadline, done = time.time() + seconds, 0
    while time.time() < deadline:
        raw.pair(ids)
        done += 1
    raw.conn.close()
    return done


def _client(url: str, seconds: float, ready: Any, go: Any, out: Any) -> None:
    out.put(_pairs(url, seconds, 1, ready, go))


def measure(kind: str, url: str, clients: int, mode: str, seconds: float) -> float:
    from aisched_prefect.ledger import Ledger

    Ledger(url).close()  # schema first, outside the timing
    if kind == "raw":  # the raw loop runs one client: it has no group commit to share among threads
        return _raw_pairs(url, seconds) / seconds
    if mode == "threads":
        return _pairs(url, seconds, clients) / seconds
    ctx = mp.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_client, args=(url, seconds, ready, go, out)) for _ in range(clients)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=300)
    go.set()
    total = sum(out.get(timeout=seconds + 120) for _ in procs)
    for p in procs:
        p.join()
    return total / seconds


class _Backend:
    """A fresh, empty database for each measurement."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> str | None:
        if self.name == "sqlite":
            self.tmp = tempfile.TemporaryDirectory()
            return f"sqlite:///{self.tmp.name}/ledger.db"
        import sqlalchemy as sa

        self.engine = sa.create_engine(POSTGRES.replace("postgresql://", "postgresql+psycopg://", 1))
        try:
            with self.engine.begin() as conn:
                self.schema = f"bench_{uuid.uuid4().hex[:8]}"
                conn.exec_driver_sql(f"CREATE SCHEMA {self.schema}")
        except Exception as exc:
            print(f"postgres: skipped ({POSTGRES} does not answer: {type(exc).__name__})")
            self.schema = None
            return None
        sep = "&" if "?" in POSTGRES else "?"
        return f"{POSTGRES}{sep}options=-csearch_path%3D{self.schema}"

    def __exit__(self, *exc: Any) -> None:
        if self.name == "sqlite":
            self.tmp.cleanup()
        elif self.schema is not None:
            with self.engine.begin() as conn:
                conn.exec_driver_sql(f"DROP SCHEMA {self.schema} CASCADE")
            self.engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measuring time per configuration")
    parser.add_argument("--clients", default="1,16", help="comma-separated client counts (the raw loop runs one)")
    parser.add_argument("--mode", choices=["processes", "threads"], default="processes")
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--rounds", type=int, default=3,
                        help="the raw loop and the ledger take turns this many times (a busy machine hits both alike)")
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    share = args.seconds / args.rounds
    print(f"reserve+settle pairs per second ({args.mode} as clients, {args.seconds:g} s each in {args.rounds} turns, "
          f"{os.cpu_count()} cores)")
    print(f"{'backend':<10} {'clients':>7} {'ledger':>9} {'raw loop':>9} {'ratio':>6}")
    for backend in args.backends.split(","):
        for n in counts:
            ledger = raw = 0.0
            for _ in range(args.rounds):
                with _Backend(backend) as url:
                    if url is None:
                        break
                    raw += measure("raw", url, 1, args.mode, share) / args.rounds
                with _Backend(backend) as url:
                    ledger += measure("ledger", url, n, args.mode, share) / args.rounds
            if raw:
                print(f"{backend:<10} {n:>7} {ledger:>9.0f} {raw:>9.0f} {ledger / raw:>6.2f}", flush=True)
    print(f"target: the ledger at least {TARGET_RATIO:g}x the raw loop (one client, one raw connection)")


if __name__ == "__main__":
    main()
