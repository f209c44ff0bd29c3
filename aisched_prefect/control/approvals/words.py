"""How an approval request reads to a person: its GPUs, its runtime, its deadline and the budgets it leaves.

Pure functions of the request's view, shared by the approval book (the request's text, filed once) and the
approval page (app.py).
"""

from __future__ import annotations

import json
from typing import Any

from aisched_prefect.wire import ApprovalView
from aisched_prefect.words import duration_in_words, time_left, who_may_approve  # noqa: F401 - approval_page and the CLI import them here

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


def closed(approval_id: str, v: ApprovalView) -> tuple[str, int]:
    """What an answer to a request that is no longer open is told, and its HTTP status."""
    if v.status == "withdrawn":
        return (f"approval {approval_id} is gone: {v.reason}; nothing of it will run and its budget is released. "
                "Fix: nothing to answer (the flow asks again when it runs again)", 410)
    return f"approval {approval_id} is already {v.status}", 409


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
            + f"\n- asked by rule: `{v.rule}`\n- who may approve: {who_may_approve(v.approvers)}\n{quorum}{signed}"
            f"- open {time_left(v.deadline)}: no answer by then denies the run\n"
            f"- approval digest: `{v.digest[:16]}`\n\n"
            f"**Answer on the control plane's page: [{v.url}]({v.url})** (open the one-time link you were sent, or "
            f"sign in there as an approver), or `aisched approve {v.id[:SHORT_ID]}`. This Prefect form has nothing to "
            "fill in. An answer typed into this Prefect form is not counted: Prefect cannot tell who typed it.")


def to_json(view: ApprovalView) -> str:
    return json.dumps(view.model_dump(mode="json"))
