"""One client process of the ledger race test: threads that reserve, settle, void and abandon holds.

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


def main(url: str, index: int, threads: int, seconds: float, lease: float, lines_json: str) -> None:
    ledger = Ledger(url, lease_seconds=lease)
    lines = [BudgetLine.model_validate(line) for line in json.loads(lines_json)]
    stats = {"reserved": 0, "refused": 0, "posted": 0, "voided": 0, "abandoned": 0, "violations": []}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds
    ids = {"flow_run_id": f"proc-{index}", "principal": f"p{index}"}

    def worker(t: int) -> None:
        rng = random.Random(index * 1000 + t)
        n = 0
        while time.monotonic() < deadline:
            n += 1
            amount = round(rng.uniform(0.01, 0.15), 6)
            task = f"{index}-{t}-{n}"
            try:
                held, _ = ledger.reserve([l.model_copy(update={"amount": amount}) for l in lines], kind="admission",
                                         payload={"task": task}, task_run_id=task, **ids)
            except BudgetExceeded:
                with lock:
                    stats["refused"] += 1
                time.sleep(rng.uniform(0, 0.01))
                continue
            bad = [h.model_dump() for h in held if h.remaining_after < -1e-9]
            with lock:
                stats["reserved"] += 1
                stats["violations"].extend(bad)
            time.sleep(rng.uniform(0, 0.02))
            roll = rng.random()
            if roll < 0.1:  # abandoned: never settled, never renewed; its lease runs out
                with lock:
                    stats["abandoned"] += 1
                continue
            if roll < 0.35:
                ledger.settle([h.id for h in held], None, kind="settlement", payload={"task": task}, task_run_id=task, **ids)
                key = "voided"
            else:  # a charge below or above the hold (above: capped by what the budget has left)
                ledger.settle([h.id for h in held], round(amount * rng.uniform(0, 1.3), 6), kind="settlement",
                              payload={"task": task}, task_run_id=task, **ids)
                key = "posted"
            with lock:
                stats[key] += 1

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    print("started", flush=True)
    for th in pool:
        th.join()
    print(json.dumps(stats), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), sys.argv[6])
