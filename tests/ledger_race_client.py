"""One client process of the ledger race test: threads that reserve, settle, void and abandon holds, and one
that keeps renewing the holds still in use (racing the settlements, as a runner's watcher does).

Run by tests/test_ledger_race.py (and killed with SIGKILL by it, some of the time).
Prints one JSON line: what this process did and any violation it saw.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time

from aisched_prefect.ledger import BudgetExceeded, Ledger
from blocks import BudgetLine


def main(url: str, index: int, threads: int, seconds: float, leases: str, lines_json: str) -> None:
    """`leases`: comma-separated lease lengths, taken by the threads in turn (short ones expire during the race)."""
    lease_of = [float(x) for x in leases.split(",")]
    ledger = Ledger(url, lease_seconds=lease_of[0])
    lines = [BudgetLine.model_validate(line) for line in json.loads(lines_json)]
    stats = {"reserved": 0, "refused": 0, "posted": 0, "voided": 0, "abandoned": 0, "renewals": 0, "violations": []}
    lock = threading.Lock()
    live: set[str] = set()  # holds taken and not yet settled or abandoned
    ids = {"flow_run_id": f"proc-{index}", "principal": f"p{index}"}
    print("ready", flush=True)
    sys.stdin.readline()  # every client imported and connected: all start racing at once
    deadline = time.monotonic() + seconds

    def worker(t: int) -> None:
        rng = random.Random(index * 1000 + t)
        lease = lease_of[t % len(lease_of)]
        n = 0
        while time.monotonic() < deadline:
            n += 1
            amount = round(rng.uniform(0.01, 0.15), 6)
            task = f"{index}-{t}-{n}"
            try:
                held, _ = ledger.reserve([l.model_copy(update={"amount": amount}) for l in lines], kind="admission",
                                         payload={"task": task}, task_run_id=task, lease_seconds=lease, **ids)
            except BudgetExceeded:
                with lock:
                    stats["refused"] += 1
                time.sleep(rng.uniform(0, 0.01))
                continue
            except Exception as exc:  # a deadlock, a failed write: never expected
                with lock:
                    stats["violations"].append(f"reserve: {exc!r}")
                continue
            bad = [h.model_dump() for h in held if h.remaining_after < -1e-9]
            roll = rng.random()
            with lock:
                stats["reserved"] += 1
                stats["violations"].extend(bad)
                if roll >= 0.1:
                    live.update(h.id for h in held)
            time.sleep(rng.uniform(0, 0.02))
            if roll < 0.1:  # abandoned: never settled, never renewed; its lease runs out
                with lock:
                    stats["abandoned"] += 1
                continue
            charge = None if roll < 0.35 else round(amount * rng.uniform(0, 1.3), 6)  # below or above the hold
            try:
                ledger.settle([h.id for h in held], charge, kind="settlement", payload={"task": task}, task_run_id=task, **ids)
            except Exception as exc:
                with lock:
                    stats["violations"].append(f"settle: {exc!r}")
                continue
            with lock:
                stats["voided" if charge is None else "posted"] += 1
                live.difference_update(h.id for h in held)

    def renewer() -> None:
        rng = random.Random(index)
        while time.monotonic() < deadline:
            with lock:
                ids_now = list(live)
            rng.shuffle(ids_now)
            try:
                ledger.renew(ids_now)
            except Exception as exc:
                with lock:
                    stats["violations"].append(f"renew: {exc!r}")
            with lock:
                stats["renewals"] += 1
            time.sleep(0.25)

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)] + [threading.Thread(target=renewer)]
    for th in pool:
        th.start()
    print("started", flush=True)
    for th in pool:
        th.join()
    print(json.dumps(stats), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5], sys.argv[6])
