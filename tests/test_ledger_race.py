"""Budgets cannot be overspent: 8 processes x 16 threads race for a small budget (each process renewing its
holds while they settle), some killed with SIGKILL.

At every moment the test observes, and afterwards, posted + pending <= limit on
every account; every hold ends posted, voided or expired; each account's books
equal the sum of its holds' charges *and* the charges the evidence log
records, to the micro-unit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from aisched_prefect import Ledger
from aisched_prefect.ledger import holds
from blocks import BudgetLine

pytestmark = pytest.mark.slow  # eight racing processes on each database: minutes on a busy host

CLIENT = Path(__file__).with_name("ledger_race_client.py")
PROCESSES, THREADS, SECONDS = 8, 16, 4.0
# Half the threads hold for 1 s: their abandoned holds run out and expire during the race (lazily, when a
# reservation needs the room). The other half hold for longer than the race: what they and the killed
# processes abandon is still pending when the race ends, and expires in the sweep after it.
LEASES = (1.0, SECONDS + 1.0)
KILLED = (2, 5)  # these processes get SIGKILL half-way, holds and all
PERIOD = "2026-11"


def _lines(index: int) -> list[dict]:
    """Two levels: a team budget over two flow budgets (3 + 3 > 5: the team binds too)."""
    return [BudgetLine(budget="team", period=PERIOD, limit=5.0).model_dump(),
            BudgetLine(budget=f"team/flow-{index % 2}", period=PERIOD, limit=3.0).model_dump()]


def _check_books(ledger: Ledger) -> dict[str, float]:
    """Each account's posted and pending equal its holds' charges and reservations, and the evidence log's."""
    with ledger.engine.connect() as conn:
        rows = conn.execute(sa.select(holds)).all()
    by_id = {r.id: r for r in rows}
    charged_by_evidence: dict[str, int] = {}
    for rec in ledger.records():
        if rec.kind == "settlement":
            for s in rec.payload["settlements"]:
                if s["first"]:
                    b = by_id[s["hold_id"]].budget
                    charged_by_evidence[b] = charged_by_evidence.get(b, 0) + round(s["charged"] * 1_000_000)
        elif rec.kind == "hold-expired":
            for h in rec.payload["holds"]:
                b = rec.payload["budget"]
                charged_by_evidence[b] = charged_by_evidence.get(b, 0) + round(h["charged"] * 1_000_000)
    out = {}
    for acct in ledger.accounts():
        mine = [r for r in rows if r.budget == acct["budget"]]
        assert {r.status for r in mine} <= {"posted", "voided", "expired"}, "a hold was left pending"
        posted = sum(r.charged_micros for r in mine)
        assert round(acct["posted"] * 1_000_000) == posted, f"{acct['budget']}: books do not match its holds"
        assert charged_by_evidence.get(acct["budget"], 0) == posted, f"{acct['budget']}: books do not match the evidence"
        assert acct["pending"] == 0 and acct["posted"] <= acct["limit"]
        out[acct["budget"]] = acct["posted"]
    return out


def test_racing_processes_never_overspend(ledger_url):
    ledger = Ledger(ledger_url)  # creates the schema before the clients race for it
    env = {**os.environ, "PYTHONPATH": str(CLIENT.parent.parent)}
    procs = [subprocess.Popen([sys.executable, str(CLIENT), ledger_url, str(i), str(THREADS), str(SECONDS),
                               ",".join(map(str, LEASES)), json.dumps(_lines(i))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
             for i in range(PROCESSES)]
    for p in procs:  # a loaded machine imports slowly: the race starts once every client is ready
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        assert p.stdout.readline().strip() == "started"
    overspends: list[dict] = []
    samples = 0
    stop = threading.Event()

    def observe() -> None:
        nonlocal samples
        while not stop.is_set():
            for acct in ledger.accounts():
                if acct["posted"] + acct["pending"] > acct["limit"] + 1e-9:
                    overspends.append(acct)
            samples += 1

    observer = threading.Thread(target=observe)
    observer.start()
    time.sleep(SECONDS / 2)
    for i in KILLED:
        procs[i].send_signal(signal.SIGKILL)
    results = []
    for i, p in enumerate(procs):
        out, _ = p.communicate(timeout=120)
        if i in KILLED:
            assert p.returncode == -signal.SIGKILL
        else:
            assert p.returncode == 0, out
            results.append(json.loads(out.strip().splitlines()[-1]))
    stop.set()
    observer.join()

    assert overspends == [] and samples > 10
    assert all(r["violations"] == [] for r in results)
    # a real race: the books filled up while threads still asked (how many asks fit in the race depends on the load)
    assert sum(r["reserved"] for r in results) >= 20 and sum(r["refused"] for r in results) > 0
    with ledger.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(holds).where(holds.c.status == "pending")).scalar() > 0
    time.sleep(max(LEASES) + 0.5)  # the killed processes' holds and the abandoned ones run out of lease
    expired = ledger.expire_holds()
    assert expired, "the killed processes' holds should have expired"
    posted = _check_books(ledger)
    assert posted["team"] == pytest.approx(posted["team/flow-0"] + posted["team/flow-1"], abs=1e-6)
    assert ledger.verify().ok
    print(f"\n[race {ledger.engine.dialect.name}] {samples} samples, 0 overspends, "
          f"{sum(r['reserved'] for r in results)} holds, {sum(r['refused'] for r in results)} refused, "
          f"{sum(r['renewals'] for r in results)} renewals, {len(expired)} expired")
