"""Warm bodies' idle time shown beside the work it served, with its share (`aisched report`).

Before, `aisched report --by kind` showed `warm-idle` as a kind of its own, 1.85 USD against 0.17 USD of inference,
and nobody could tell which work left it. An idle period's record names the task and flow run of the run that left
its body warm, so each is counted with the work of that task: the kind it served, its money, and its share of that
work's charge (idle money / work money: a map whose idle share is 25 % paid a quarter on top of its runs).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from aisched_prefect.reports.usage import UsageReport, UsageRow, fmt_amount

IDLE = "warm-idle"


def served_kind(idle: UsageRow, work: list[UsageRow]) -> str:
    """The kind of the work an idle period served: that of the runs of its task in its flow run."""
    for r in work:
        if r.task == idle.task and r.flow_run_id == idle.flow_run_id and r.kind:
            return r.kind
    for r in work:  # its flow run is not in the report (filtered by date): the task's kind anywhere
        if r.task == idle.task and r.kind:
            return r.kind
    return "(unknown)"


def idle_beside_work(rows: list[UsageRow]) -> list[dict[str, Any]]:
    """Per kind of work that left bodies warm: its runs and money, its idle periods, seconds and money, the share."""
    work = [r for r in rows if r.kind != IDLE]
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r.kind != IDLE:
            continue
        kind = served_kind(r, work)
        g = out.setdefault(kind, {"kind": kind, "periods": 0, "idle_seconds": 0.0, "idle_money": Decimal("0")})
        g["periods"] += r.periods
        g["idle_seconds"] += r.seconds or 0.0
        g["idle_money"] += r.money
    for kind, g in out.items():
        mine = [r for r in work if r.kind == kind]
        g["runs"], g["work_money"] = len(mine), sum((r.money for r in mine), Decimal("0"))
        g["share"] = float(g["idle_money"] / g["work_money"]) if g["work_money"] else None
    return sorted(out.values(), key=lambda g: g["kind"])


def share_words(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%} of its work's charge"


def idle_table(rows: list[UsageRow]) -> list[dict[str, str]]:
    """`idle_beside_work` as display strings (the table `aisched report` prints when bodies idled)."""
    return [{"work kind": g["kind"], "runs": str(g["runs"]), "work money": fmt_amount(g["work_money"], "money"),
             "idle periods": str(g["periods"]), "idle seconds": f"{g['idle_seconds']:.0f}",
             "idle money": fmt_amount(g["idle_money"], "money"), "idle share": share_words(g["share"])}
            for g in idle_beside_work(rows)]


def kind_table(report: UsageReport) -> list[dict[str, str]]:
    """`--by kind`: each kind of work, then the idle time its bodies left as a line of its own under it, with its
    share; the total as before."""
    by = report.by
    idle = {g["kind"]: g for g in idle_beside_work(report.runs)}
    out: list[dict[str, str]] = []
    for g in report.groups:
        if g.key == IDLE:
            continue
        out.append({by: g.key, "runs": str(g.runs), "GPU-hours": fmt_amount(g.gpu_hours, "gpu-hours"),
                    "tokens": str(g.tokens), "money": fmt_amount(g.money, "money"),
                    "uncovered": fmt_amount(g.uncovered, "money") if g.uncovered else ""})
        i = idle.pop(g.key, None)
        if i is not None:
            out.append(_idle_line(by, i, report))
    out += [_idle_line(by, i, report) for i in idle.values()]  # idle whose work is outside the report
    t = report.total
    out.append({by: t.key, "runs": str(t.runs), "GPU-hours": fmt_amount(t.gpu_hours, "gpu-hours"),
                "tokens": str(t.tokens), "money": fmt_amount(t.money, "money"),
                "uncovered": fmt_amount(t.uncovered, "money") if t.uncovered else ""})
    return out


def _idle_line(by: str, g: dict[str, Any], report: UsageReport) -> dict[str, str]:
    rows = [r for r in report.runs if r.kind == IDLE and served_kind(r, [w for w in report.runs if w.kind != IDLE])
            == g["kind"]]
    hours = sum((r.gpu_hours for r in rows), Decimal("0"))
    return {by: f"  {IDLE} of {g['kind']} ({share_words(g['share'])})", "runs": f"{g['periods']} idle periods",
            "GPU-hours": fmt_amount(hours, "gpu-hours"), "tokens": "0", "money": fmt_amount(g["idle_money"], "money"),
            "uncovered": ""}
