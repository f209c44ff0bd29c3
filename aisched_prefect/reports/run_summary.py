"""A flow run's evidence summed up for a person: per task, its runs, cold and warm starts, bodies, idle time.

`aisched explain FLOW_RUN` of a 200-shard map printed 3,000 lines, never said cold or warm, and printed idle records
as raw dicts. These are the tables it prints first instead (aisched_prefect.cli.evidence): one row per task of the
flow run (shards, cold and warm starts, bodies, what the runs were charged, idle time and its charge per body), one
row per warm body, and the first runs, each saying cold or warm and which body; `--all` prints every record.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from aisched_prefect.evidence import EvidenceRecord
from aisched_prefect.reports.runs import charged_money as _charged

WARM_KINDS = ("warm-hold", "warm-idle", "warm-refused")


def run_rows(records: list[EvidenceRecord]) -> list[dict[str, Any]]:
    """One row per settled run (a task run's attempt): task, outcome, seconds, charged, cold or warm, which body."""
    out = []
    for r in records:
        if r.kind != "settlement" or (r.task_run_id or "").startswith("warm-"):
            continue
        p, body = r.payload, r.payload.get("body") or {}
        place = p.get("placement") or {}
        start = body.get("start") or "fresh process"
        out.append({"record": r.seq, "task run": r.task_run_id, "task": p.get("task"), "outcome": p.get("outcome"),
                    "start": start, "body": body.get("id", "-"), "body run": body.get("runs", "-"),
                    "idle before": f"{body['idle_before']:.1f} s" if body.get("idle_before") else "-",
                    "worker": place.get("name") or place.get("worker") or "-",
                    "seconds": f"{p.get('seconds') or 0:.1f}", "charged": f"{_charged(p):.6f}"})
    return out


def body_rows(records: list[EvidenceRecord]) -> list[dict[str, Any]]:
    """One row per warm body: which task, its runs (the first cold), its idle periods, idle seconds and charge,
    and why its last idle period ended."""
    bodies: dict[str, dict[str, Any]] = {}
    for r in records:
        p = r.payload
        body = (p.get("body") or {}) if r.kind == "settlement" else {"id": p.get("body")} if r.kind in WARM_KINDS else {}
        if not body.get("id"):
            continue
        row = bodies.setdefault(str(body["id"]), {"body": str(body["id"]), "task": p.get("task"), "runs": 0, "cold": 0,
                                                  "idle periods": 0, "idle s": 0.0, "idle charged": 0.0, "ended": "-"})
        if r.kind == "settlement":
            row["runs"] += 1
            row["cold"] += body.get("start") == "cold"
        elif r.kind == "warm-idle":
            row["idle periods"] += int(p.get("periods") or 1)  # a stretch of back-to-back runs settles several
            row["idle s"] += float(p.get("seconds") or 0.0)
            row["idle charged"] += _charged(p)
            row["ended"] = p.get("ended") or "-"
        elif r.kind == "warm-refused":
            row["ended"] = f"refused: {p.get('reason')}"
    return list(bodies.values())


def task_rows(records: list[EvidenceRecord]) -> list[dict[str, Any]]:
    """One row per task of the records: shards (task runs), cold and warm starts, bodies, runs' charge, idle
    seconds and charge per body, and the idle share: idle money / the runs' money (as `aisched report` says it)."""
    runs, bodies = run_rows(records), body_rows(records)
    tasks: dict[str, dict[str, Any]] = defaultdict(lambda: {"shards": set(), "cold": 0, "warm": 0, "fresh": 0,
                                                            "charged": 0.0, "seconds": 0.0})
    for row in runs:
        t = tasks[str(row["task"])]
        t["shards"].add(row["task run"])
        t["cold" if row["start"] == "cold" else "warm" if row["start"] == "warm" else "fresh"] += 1
        t["charged"] += float(row["charged"])
        t["seconds"] += float(row["seconds"])
    out = []
    for name, t in tasks.items():
        mine = [b for b in bodies if str(b["task"]) == name]
        idle_s, idle_m = sum(b["idle s"] for b in mine), sum(b["idle charged"] for b in mine)
        n = max(len(mine), 1)
        out.append({"task": name, "shards": len(t["shards"]), "cold starts": t["cold"], "warm starts": t["warm"],
                    "fresh processes": t["fresh"], "bodies": len(mine), "run s": f"{t['seconds']:.1f}",
                    "charged": f"{t['charged']:.6f}", "idle s per body": f"{idle_s / n:.1f}",
                    "idle charged per body": f"{idle_m / n:.6f}", "idle charged": f"{idle_m:.6f}",
                    "idle share": f"{idle_m / t['charged']:.0%}" if t["charged"] else "-"})
    return out
