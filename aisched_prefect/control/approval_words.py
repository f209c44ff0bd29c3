"""How an approval request reads to a person: its GPUs, its runtime, its deadline and the budgets it leaves.

Pure functions of the request's view, shared by the approval book (the request's text, filed once) and the
approval page (app.py).
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any

from aisched_prefect.wire import ApprovalView

SHORT_ID = 8  # `aisched approvals list` shows this many characters of an id; any unique prefix this long resolves

def budget_left(holds: list[Any], currency: str) -> str:
    """What each budget the run holds against has left once this hold is counted."""
    return ", ".join(f"{h.budget}: {h.remaining_after:.2f} {currency if h.unit == 'money' else h.unit}" for h in holds)


def gpus_in_words(request: dict[str, Any]) -> str:
    """What a run asks for, as a person reads it: '2 H100 GPUs, each with at least 40 GB', 'half of one GPU'.

    >>> gpus_in_words({"gpus": 2, "gpu_type": "H100", "gpu_memory_gb": 40})
    '2 H100 GPUs, each with at least 40 GB'
    >>> gpus_in_words({"gpus": 0.5, "gpu_type": ["A10", "L4"]})
    'half of one A10 or L4 GPU'
    >>> gpus_in_words({"gpus": 1})
    '1 GPU of any type'
    """
    gpus = float(request.get("gpus") or 0)
    if not gpus:
        return "no GPU"
    types = request.get("gpu_type")
    names = " or ".join(types if isinstance(types, list) else [types]) if types else ""
    memory = request.get("gpu_memory_gb")
    if gpus < 1:
        share = {0.5: "half", 0.25: "a quarter"}.get(gpus, f"{gpus:g}")
        out = f"{share} of one {names + ' ' if names else ''}GPU" + (f" ({memory:g} GB reserved)" if memory else "")
    else:
        n = f"{gpus:g}"
        out = f"{n} {names + ' ' if names else ''}GPU{'s' if gpus != 1 else ''}{'' if names else ' of any type'}"
        if memory:
            out += f", {'each ' if gpus > 1 else ''}with at least {memory:g} GB"
    hosts = request.get("hosts")
    return out + (f", on {hosts} hosts" if hosts and hosts > 1 else "")


def duration_in_words(seconds: float) -> str:
    """'1 h 5 min', '4 min 10 s', '12 s'."""
    s = max(0, int(round(seconds)))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    if h:
        return f"{h} h {m} min" if m else f"{h} h"
    if m:
        return f"{m} min {sec} s" if sec else f"{m} min"
    return f"{sec} s"


def time_left(deadline: float, now: float | None = None) -> str:
    """The deadline as a time, and how long until it: 'until 14:32:05 UTC (in 4 min 10 s)'."""
    now = time.time() if now is None else now
    at = datetime.fromtimestamp(deadline, timezone.utc)
    when = at.strftime("%H:%M:%S UTC") if at.date() == datetime.fromtimestamp(now, timezone.utc).date() \
        else at.strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"until {when} (in {duration_in_words(deadline - now)})"


def describe(v: ApprovalView, left: str = "") -> str:
    """The markdown a person reads before deciding (Prefect's pause form shows it; the page shows the same)."""
    req = ", ".join(f"{k}={val}" for k, val in v.request.items() if val not in (None, 0, 0.0, False))
    quorum = f"- approvals needed: {v.approvals_required} different approvers\n" if v.approvals_required > 1 else ""
    signed = "- this rule counts only signed answers (`aisched approve --key`)\n" if v.require_signature else ""
    what = v.request.get("kind", "") + (f" of {v.request['model']}" if v.request.get("model") else "")
    runtime = f", about {duration_in_words(v.request['est_seconds'])}" if v.request.get("est_seconds") else ""
    return (f"**Approve AI task `{v.task_name}`?** ({what}: {gpus_in_words(v.request)}{runtime})\n\n"
            f"- principal: `{v.principal}`, grant chain `{' -> '.join(v.chain)}`\n"
            f"- request: {req}\n"
            f"- estimated cost: {v.est_cost:.4f} {v.currency}" + (f" (budget left after the hold: {left})" if left else "")
            + f"\n- asked by rule: `{v.rule}`\n{quorum}{signed}"
            f"- open {time_left(v.deadline)}: no answer by then denies the run\n"
            f"- approval digest: `{v.digest[:16]}`\n\n"
            f"**Answer on the control plane's page: [{v.url}]({v.url})** (open the one-time link you were sent, or "
            f"sign in there as an approver), or `aisched approve {v.id[:SHORT_ID]}`. This Prefect form has nothing to "
            "fill in. An answer typed into this Prefect form is not counted: Prefect cannot tell who typed it.")


def to_json(view: ApprovalView) -> str:
    return json.dumps(view.model_dump(mode="json"))
