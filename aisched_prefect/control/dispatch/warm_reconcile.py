"""A control plane's warm books against what the workers say: after a start (a plane killed and started again), a
reconnect to the scheduler, and now and then as a backstop for an end event that was lost.

Why: while the plane was away, bodies ended (their keep-warm time passed, their worker died) and their
`aisched-warm-body` events went nowhere. Each worker remembers its idle bodies, its busy ones (and how long each
waited before the run it took last) and the idle bodies that ended lately (how long each waited, why it ended); the
ticket registry remembers when each worker left. So each idle period the rows still call idle is settled to its
real end: the length the worker reports, or up to when its worker left, never the whole keep-warm time by default.
A body a worker keeps idle that no plane booked (its run's outcome was lost with the plane that dispatched it) is
ended: nobody would account for its idle time or check its authority.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from aisched_prefect.control.dispatch.warm import WarmBooks

logger = logging.getLogger("aisched_prefect.control")
UNKNOWN_GRACE_SECONDS = 30.0  # an idle body nobody booked may be one whose run's outcome is still on its way
LEFT_OP = "gpu_workers_left"


def worker_reports(client: Any) -> tuple[dict[str, Any], dict[str, float]]:
    """Every worker's answer (address -> its `warm_report`, or None where it did not answer) and when each worker
    that left did (the scheduler's clock); one round trip each."""
    from dask_gpu.client.cluster import broadcast

    reports = {address: (answer.get("warm_report") if isinstance(answer, dict) else None)
               for address, answer in broadcast(client, "gpu_inventory").items()}
    try:
        left = client.sync(getattr(client.scheduler, LEFT_OP))
    except Exception:  # a scheduler without the ticket registry: workers that left are settled to now
        left = {}
    return reports, {str(k): float(v) for k, v in (left or {}).items()}


def reconcile(books: WarmBooks, fetch: Callable[[], tuple[dict[str, Any], dict[str, float]]],
              end_bodies: Callable[[list[str], str], Any]) -> dict[str, int]:
    """Settle the idle periods whose bodies ended unheard, end the idle bodies nobody booked; what was done.
    `fetch`: the workers' reports and when workers left (worker_reports). Only periods booked before the workers
    were asked are judged by their answers (one booked since may be a run that had not parked yet)."""
    books.load()
    periods = books.periods()
    reports, left = fetch()
    now = time.time()
    done = {"settled": 0, "taken": 0, "unknown_ended": 0}
    still = {id(p) for p in books.periods()}
    for p in periods:
        if id(p) not in still:  # settled, or carried on by a run of its body, while the workers were asked: their
            continue            # answers are older than that (a busy map's runs, taken for lost ends, 2 to 11 a pass)
        if p.worker not in reports:  # the worker left: the body went with it
            at = min(left.get(p.worker, now), now)
            books.ended(p.body, p.runs, p.idle_at(at), f"its worker {p.worker} left")
            done["settled"] += 1
            continue
        report = reports[p.worker]
        if report is None:  # it did not answer this time: asked again later
            continue
        if any(b["id"] == p.body and int(b["runs"]) == p.runs for b in report.get("idle", ())):
            continue  # still waiting, as booked
        busy = next((b for b in report.get("busy", ()) if b["id"] == p.body), None)
        if busy is not None:
            if int(busy["runs"]) in (p.runs, p.runs + 1):  # a run of its key took it: that run's outcome was lost
                books.ended(p.body, p.runs, float(busy.get("idle_before") or 0.0), "a run of its key", taken=True)
                done["taken"] += 1
            continue
        end = next((e for e in reversed(report.get("ended", ())) if e["id"] == p.body and int(e["runs"]) == p.runs),
                   None)
        if end is not None:
            books.ended(p.body, p.runs, float(end["idle"]), str(end.get("reason") or ""), worker=p.worker)
        else:  # ended too long ago for its worker to remember: to now, at most its keep-warm time
            books.ended(p.body, p.runs, p.idle_at(now), "its worker no longer has it")
        done["settled"] += 1
    booked = {p.body for p in periods} | {p.body for p in books.periods()}
    unknown = [b["id"] for report in reports.values() if report for b in report.get("idle", ())
               if b["id"] not in booked and float(b.get("idle") or 0.0) >= UNKNOWN_GRACE_SECONDS]
    if unknown:
        end_bodies(unknown, "no control plane booked it (its run's outcome was lost)")
        done["unknown_ended"] = len(unknown)
    if any(done.values()):
        logger.warning("warm bodies reconciled with the workers: %s", done)
    return done
