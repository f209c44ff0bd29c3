"""Evidence turned into one row per AI task run: the table people read."""

from __future__ import annotations

from typing import Any

from aisched_prefect.evidence import EvidenceRecord


def _request_summary(req: dict[str, Any]) -> str:
    parts = [req.get("kind", "?")]
    if req.get("gpus"):
        types = req.get("gpu_type") or "any GPU"
        parts.append(f"{req['gpus']:g} x {types if isinstance(types, str) else ' or '.join(types)}")
    if req.get("gpu_memory_gb"):
        parts.append(f">= {req['gpu_memory_gb']:g} GB")
    if req.get("model"):
        parts.append(req["model"])
    return ", ".join(parts)


def evidence_rows(records: list[EvidenceRecord]) -> list[dict[str, Any]]:
    """One row per task run: request, principal, grant, placement, reserved, charged, decision."""
    rows: dict[str, dict[str, Any]] = {}
    for r in records:
        key = r.task_run_id or f"seq-{r.seq}"
        p = r.payload
        row = rows.setdefault(key, {
            "task": p.get("task"), "task_run_id": r.task_run_id, "principal": r.principal,
            "request": _request_summary(p.get("request", {})), "grant": None, "worker": None,
            "devices": None, "reserved": 0.0, "charged": 0.0, "decision": None, "records": "",
        })
        row["records"] = f"{row['records']},{r.seq}".lstrip(",")
        row["grant"] = p.get("grant", row["grant"])
        if r.kind in ("admission", "approval-requested"):
            row["reserved"] = round(sum(h["reserved"] for h in p.get("holds", [])[:1]), 6)
            row["decision"] = "admitted" if r.kind == "admission" else "awaiting approval"
        elif r.kind == "denial":
            row["decision"] = f"denied ({p.get('stage')}): {p.get('reason')}"
        elif r.kind == "approval":
            row["decision"] = f"{'approved' if p.get('approved') else 'rejected'} by {p.get('approver')}"
        elif r.kind == "settlement":
            placement = p.get("placement") or {}
            row["worker"] = placement.get("worker")
            row["devices"] = ",".join(str(d) for d in placement.get("devices", [])) or None
            row["charged"] = round(sum(s["charged"] for s in p.get("settlements", [])[:1]), 6)
            row["decision"] = p.get("outcome")
    return list(rows.values())
