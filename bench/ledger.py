"""Ledger throughput: reserve+settle pairs per second on SQLite and Postgres, 1 and 16 concurrent clients.

Each pair is what one admitted AI task costs the ledger: a hold on its budget
with its admission evidence (one transaction), then the settlement with its
evidence (another). A client is a separate process with its own Ledger
(`--mode processes`, as flow runs on several hosts are), or a thread of one
process sharing one Ledger (`--mode threads`, as the tasks of one flow run
are; their writes are group-committed).

    make bench-ledger     # or: .venv/bin/python bench/ledger.py --seconds 5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import threading
import time
import uuid
from typing import Any

TARGET_SQLITE_ONE_CLIENT = 2000.0
POSTGRES = os.environ.get("AISCHED_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


def _pairs(url: str, seconds: float, threads: int, ready: Any = None, go: Any = None) -> int:
    """Reserve+settle as fast as possible for `seconds` once `go` is set; returns pairs done."""
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


def _client(url: str, seconds: float, ready: Any, go: Any, out: Any) -> None:
    out.put(_pairs(url, seconds, 1, ready, go))


def measure(url: str, clients: int, mode: str, seconds: float) -> float:
    from aisched_prefect.ledger import Ledger

    Ledger(url).close()  # schema first, outside the timing
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


def _postgres_schema() -> tuple[str, object] | None:
    import sqlalchemy as sa

    engine = sa.create_engine(POSTGRES.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.begin() as conn:
            schema = f"bench_{uuid.uuid4().hex[:8]}"
            conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
    except Exception as exc:
        print(f"postgres: skipped ({POSTGRES} does not answer: {type(exc).__name__})")
        return None
    sep = "&" if "?" in POSTGRES else "?"
    return f"{POSTGRES}{sep}options=-csearch_path%3D{schema}", (engine, schema)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measuring time per configuration")
    parser.add_argument("--clients", default="1,16", help="comma-separated client counts")
    parser.add_argument("--mode", choices=["processes", "threads"], default="processes")
    parser.add_argument("--backends", default="sqlite,postgres")
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    print(f"reserve+settle pairs per second ({args.mode} as clients, {args.seconds:g} s each, {os.cpu_count()} cores)")
    print(f"{'backend':<10} {'clients':>7} {'pairs/s':>9}")
    results = {}
    for backend in args.backends.split(","):
        for n in counts:
            if backend == "sqlite":
                with tempfile.TemporaryDirectory() as tmp:
                    rate = measure(f"sqlite:///{tmp}/ledger.db", n, args.mode, args.seconds)
            else:
                made = _postgres_schema()
                if made is None:
                    break
                url, (engine, schema) = made
                try:
                    rate = measure(url, n, args.mode, args.seconds)
                finally:
                    with engine.begin() as conn:
                        conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
            results[(backend, n)] = rate
            print(f"{backend:<10} {n:>7} {rate:>9.0f}", flush=True)
    one = results.get(("sqlite", 1))
    if one is not None:
        print(f"sqlite, 1 client: {one:.0f} pairs/s = {one / TARGET_SQLITE_ONE_CLIENT:.2f} x the target "
              f"({TARGET_SQLITE_ONE_CLIENT:.0f}/s)")


if __name__ == "__main__":
    main()
