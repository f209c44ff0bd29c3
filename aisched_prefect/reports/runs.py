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


def money_of(items: list[dict[str, Any]], field: str) -> float:
    """`field` summed over the holds or settlements of the run's first money account (the one a person reads)."""
    money = [i for i in items if i.get("unit", "money") == "money"]
    if not money:
        return 0.0
    first = money[0].get("budget")
    return round(sum(i[field] for i in money if i.get("budget") == first), 6)


def charged_money(p: dict[str, Any]) -> float:
    """Money charged by a settlement record: its first money account, as `aisched evidence show` reads it."""
    if p.get("settlements"):
        return money_of(p["settlements"], "charged")
    charges = p.get("charges") or {}
    return round(float(next(iter(charges.values()), 0.0)), 6)


def flatten(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    """A record's payload as (field, value) lines a table shows: nested objects by dotted name, never as a dict."""
    if isinstance(value, dict):
        out: list[tuple[str, str]] = []
        for k, v in value.items():
            out += flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out = []
        for i, v in enumerate(value):
            out += flatten(v, f"{prefix}[{i}]")
        return out
    if isinstance(value, list):
        return [(prefix, ", ".join(str(v) for v in value) or "-")]
    if isinstance(value, float):
        return [(prefix, f"{value:.6g}")]
    return [(prefix, "-" if value is None else str(value))]


def evidence_rows(records: list[EvidenceRecord]) -> list[dict[str, Any]]:
    """One row per attempt of each task run (a retry, or a requeue, is a row of its own): request, principal,
    grant, placement (`worker` is the worker's name, `address` where it was), reserved, charged, decision.

    Records of no task run (credentials, applied configuration, grants: see `operator_rows`) are not rows here.
    """
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    attempt: dict[str, int] = {}  # task run -> its attempt now: a new admission after a settlement is the next one
    settled: set[str] = set()
    for r in records:
        if not r.task_run_id:
            continue
        run = r.task_run_id
        p = r.payload
        if r.kind == "admission" and run in settled:  # a retry (or a requeue) of the same task run: a row of its own
            settled.discard(run)
            attempt[run] = attempt.get(run, 1) + 1
        if r.kind == "settlement":
            settled.add(run)
        n = attempt.setdefault(run, 1)
        row = rows.setdefault((run, n), {
            "task": p.get("task"), "task_run_id": r.task_run_id, "attempt": n, "principal": r.principal,
            "request": _request_summary(p.get("request", {})), "grant": None, "worker": None, "address": None,
            "devices": None, "reserved": 0.0, "charged": 0.0, "decision": None, "records": "",
        })
        row["records"] = f"{row['records']},{r.seq}".lstrip(",")
        row["grant"] = p.get("grant", row["grant"])
        if r.kind == "approval-requested" or (r.kind == "admission" and not row["reserved"]):
            row["reserved"] = money_of(p.get("holds", []), "reserved")
            row["decision"] = "admitted" if r.kind == "admission" else "awaiting approval"
        elif r.kind == "admission":
            row["decision"] = "admitted"
        elif r.kind in ("top-up", "shard-hold"):  # a map's later shard holds as it starts
            row["reserved"] = round(row["reserved"] + money_of(p.get("holds", []), "reserved"), 6)
        elif r.kind == "denial":
            row["decision"] = f"denied ({p.get('stage')}): {p.get('reason')}"
        elif r.kind == "approval":
            row["decision"] = f"{'approved' if p.get('approved') else 'rejected'} by {p.get('approver')}"
        elif r.kind == "worker-died":
            slurm = p.get("slurm") or {}
            ended = f"; Slurm job {slurm.get('job')}: {slurm.get('state')}" if slurm else ""
            row["decision"] = f"worker {p.get('name') or p.get('worker')} died (devices {_devices(p.get('devices'))}{ended})"
        elif r.kind == "settlement":
            placement = p.get("placement") or {}
            row["worker"] = placement.get("name") or placement.get("worker")
            if placement.get("slurm_job"):  # read beside sacct: the Slurm job the worker ran in
                row["worker"] = f"{row['worker']} (Slurm job {placement['slurm_job']})"
            row["address"] = placement.get("worker")
            row["devices"] = ",".join(str(d) for d in placement.get("devices", [])) or None
            row["charged"] = money_of(p.get("settlements", []), "charged")
            row["decision"] = p.get("outcome")
            if p.get("slurm"):  # a dead worker's Slurm job, as Slurm says it ended
                row["decision"] += f" (Slurm job {p['slurm'].get('job')}: {p['slurm'].get('state')})"
            if p.get("attempts") and len(p["attempts"]) > 1:
                row["decision"] += f" ({len(p['attempts']) - 1} re-run(s) refused)"
    return list(rows.values())


def _operator_summary(kind: str, p: dict[str, Any]) -> str:
    """One line for a person: what an operator (or the control plane's own start) did."""
    if kind == "credential-issued":
        c = p.get("credential") or {}
        bound = ", ".join(f"{k} {c[k]}" for k in ("authority", "budget", "policy", "cluster") if c.get(k))
        return f"{c.get('role')} credential {c.get('id')} for {c.get('principal')} (tenant {c.get('tenant')}" + \
            (f"; {bound})" if bound else ")")
    if kind == "credential-revoked":
        return f"credential {p.get('id')} revoked"
    if kind == "config-applied":
        return f"{p.get('kind')} {p.get('name')!r} applied: version {p.get('version')} ({str(p.get('digest'))[:12]})"
    if kind == "config-drift":
        return (f"{p.get('kind')} {p.get('name')!r} edited in Prefect after version {p.get('applied_version')} was "
                "applied: not enforced until an operator applies it")
    if kind == "delegation":
        g = p.get("grant") or {}
        return f"grant {g.get('id')} delegated to {g.get('principal')} from {g.get('parent')}"
    if kind == "budget-limits":
        return f"budget limits version {p.get('version')}, from {p.get('source')}"
    if kind == "revocation":
        return f"grant {p.get('grant')} revoked" + (f": {p['reason']}" if p.get("reason") else "")
    return ", ".join(f"{k}={v}" for k, v in p.items() if k != "sig" and not isinstance(v, (dict, list)))[:160]


def operator_rows(records: list[EvidenceRecord]) -> list[dict[str, Any]]:
    """The records of no task run, one row each: credentials issued and revoked, configuration applied, grants
    delegated and revoked, drift found; who did it (`by`) and what, in words."""
    return [{"record": r.seq, "kind": r.kind, "by": r.payload.get("by") or r.principal,
             "what": _operator_summary(r.kind, r.payload)}
            for r in records if not r.task_run_id]


def _devices(devices: Any) -> str:
    return ",".join(str(d) for d in devices) if devices else "?"


def for_display(row: dict[str, Any]) -> dict[str, str]:
    """A row of `evidence_rows` as a person reads it: money with six decimals (never 3e-06), blanks for nothing."""
    out = {k: "" if v is None else str(v) for k, v in row.items()}
    for k in ("reserved", "charged"):
        if isinstance(row.get(k), (int, float)):
            out[k] = f"{row[k]:.6f}"
    return out


MONEY_NOTE = "reserved and charged: money, in the budget's currency, on the run's first money account"


def _unit(item: dict[str, Any]) -> str:
    return "" if item.get("unit", "money") == "money" else f" {item['unit']}"


def _held_lines(payload: dict[str, Any]) -> list[str]:
    return [f"        held {h.get('reserved', 0):.6f}{_unit(h)} on budget {h.get('budget')!r} ({h.get('period')}), "
            f"{h.get('remaining_after', 0):.6f} left after" for h in payload.get("holds") or []]


EVIDENCE_SCHEMA = "aisched.evidence/1"


def export_line(record: EvidenceRecord) -> dict[str, Any]:
    """One evidence record as a JSON-lines object with a versioned schema."""
    return {"schema": EVIDENCE_SCHEMA, **record.model_dump(mode="json")}


def _plan_line(plan: dict[str, Any]) -> str:
    """The estimate the GPU queue planned a run on, in words: declared x its tenant's overrun factor.

    >>> _plan_line({"declared": 600.0, "factor": 1.8, "planned": 1080.0})
    'estimate 600 s x 1.8 (tenant history) = 1080 s planned'
    >>> _plan_line({"declared": 600.0, "factor": 1.0, "planned": 600.0})
    'estimate 600 s planned as declared (x 1: the tenant has not overrun its estimates)'
    >>> _plan_line({"declared": 60.0, "factor": 4.0, "planned": 21600.0, "no_limit_plan": 21600.0})
    'no time limit: planned as 21600 s, the no_limit_plan of the queue (estimate 60 s x 4 tenant history)'
    """
    declared, factor, planned = plan.get("declared", 0.0), plan.get("factor", 1.0), plan.get("planned", 0.0)
    if "no_limit_plan" in plan:
        return (f"no time limit: planned as {planned:.0f} s, the no_limit_plan of the queue "
                f"(estimate {declared:.0f} s x {factor:.3g} tenant history)")
    if factor <= 1.0:
        return f"estimate {declared:.0f} s planned as declared (x 1: the tenant has not overrun its estimates)"
    return f"estimate {declared:.0f} s x {factor:.3g} (tenant history) = {planned:.0f} s planned"


def _body_line(body: dict[str, Any]) -> str:
    """Which process ran it: a cold start or a warm body (reused), and whether it stayed warm after."""
    start = body.get("start") or "?"
    what = (f"{start.upper()} start in body {body.get('id')} (its run {body.get('runs')}"
            + (f", idle {body['idle_before']:.1f} s before" if start == "warm" and body.get("idle_before") else "") + ")")
    return what + (f"; kept warm up to {body.get('keep', 0):.0f} s" if body.get("kept") else "; ended after the run")


def _idle_line(idle: dict[str, Any]) -> str:
    cut = f", cut from {idle['asked_seconds']:.0f} s to fit max_cost_per_run of {idle['capped_by']!r}" \
        if idle.get("capped_by") else ""
    return f"up to {idle.get('seconds', 0):.0f} s warm idle, {idle.get('cost', 0):.6f}{cut}"


def explain(records: list[EvidenceRecord]) -> str:
    """For a person: why each task run in `records` was allowed or denied, under which chain, by whom, at what cost."""
    if not records:
        return "no evidence records for that id"
    by_task: dict[str, list[EvidenceRecord]] = {}
    for r in records:
        by_task.setdefault(r.task_run_id or f"record {r.seq}", []).append(r)
    out: list[str] = []
    for task_run, recs in by_task.items():
        first = recs[0].payload
        out.append(f"Task run {task_run} (task {first.get('task')!r}) of flow run {recs[0].flow_run_id}, "
                   f"principal {recs[0].principal!r}")
        out.append(f"  request: {_request_summary(first.get('request', {}))}")
        for r in recs:
            p = r.payload
            chain = " -> ".join(p.get("chain") or ([p["grant"]] if p.get("grant") else []))
            if r.kind == "denial":
                out.append(f"  [{r.seq}] DENIED at {p.get('stage')}: {p.get('reason')}")
                out.append(f"        fix: {p.get('fix')}")
            elif r.kind in ("admission", "approval-requested"):
                verb = "ADMITTED" if r.kind == "admission" else "HELD, waiting for approval"
                if r.kind == "admission" and p.get("approval_id"):
                    why = f"approved by {p.get('approval') or '?'} (approval {p['approval_id'][:12]})"
                else:
                    why = f"policy rule: {p.get('approval_rule') or 'none (no approval needed)'}"
                out.append(f"  [{r.seq}] {verb} under grant chain {chain or '?'}; {why}")
                out.extend(_held_lines(p) or ([f"        nothing held until {p['hold'][3:]} (a map's shard)"]
                                              if p.get("hold") else []))
                if (p.get("idle") or {}).get("asked_seconds"):
                    out.append(f"        price includes its idle time: {_idle_line(p['idle'])}")
            elif r.kind == "approval-consumed":
                out.append(f"  [{r.seq}] APPROVAL USED: its one execution starts (approved by "
                           f"{', '.join(p.get('approved_by') or []) or '?'})")
            elif r.kind == "approval-suspended":
                out.append(f"  [{r.seq}] SUSPENDED waiting for a person; its holds released (nothing charged)")
            elif r.kind == "approval-unverified":
                out.append(f"  [{r.seq}] NOT COUNTED: an answer typed into the Prefect form ({p.get('said')})")
            elif r.kind == "approval-vote":
                out.append(f"  [{r.seq}] VOTE by {p.get('approver')} via {p.get('channel')}"
                           + ("" if p.get("counted") else " (not counted: already voted)"))
            elif r.kind == "top-up":
                out.append(f"  [{r.seq}] TOPPED UP by {p['top_up']['seconds']:.1f}s (cover was {p['top_up']['covered_before']:.1f}s)")
                out.extend(_held_lines(p))
            elif r.kind == "shard-hold":
                out.append(f"  [{r.seq}] HELD as the queue started it (a map's shard, admission {p.get('admission')})")
                out.extend(_held_lines(p))
            elif r.kind == "top-up-refused":
                out.append(f"  [{r.seq}] TOP-UP REFUSED: {p.get('reason')}")
            elif r.kind == "approval":
                who = p.get("approver")
                via = " -> ".join(p.get("approver_chain") or []) or "no approving grant"
                verdict = "APPROVED" if p.get("approved") else "REJECTED"
                out.append(f"  [{r.seq}] {verdict} by {who} via {p.get('channel')} ({via}): {p.get('reason') or ''}")
            elif r.kind == "worker-died":
                slurm = p.get("slurm") or {}
                ended = f"; Slurm job {slurm.get('job')}: {slurm.get('state')} {slurm.get('reason') or ''}" if slurm else ""
                out.append(f"  [{r.seq}] WORKER DIED: {p.get('name') or '?'} ({p.get('worker')}) with devices "
                           f"{_devices(p.get('devices'))}, after {p.get('seconds', 0):.1f}s{ended.rstrip()}")
            elif r.kind == "settlement":
                place = p.get("placement") or {}
                where = (f" on {place.get('name') or place.get('worker')} devices {_devices(place.get('devices'))}"
                         + (f" (Slurm job {place['slurm_job']})" if place.get("slurm_job") else "") if place else "")
                out.append(f"  [{r.seq}] SETTLED {p.get('outcome')}{where}" + (f"; error: {p['error']}" if p.get("error") else ""))
                if p.get("body"):
                    out.append(f"        {_body_line(p['body'])}")
                if place.get("queue_plan"):
                    out.append(f"        queue: {_plan_line(place['queue_plan'])}")
                for m in place.get("members") or []:  # a multi-host run: each member
                    out.append(f"        member {m.get('member')}: {m.get('name') or m.get('worker')} devices "
                               f"{_devices(m.get('devices'))}, {m.get('seconds', 0):.1f}s"
                               + ("" if m.get("ok") else f", {'stopped: ' + m['stopped'] if m.get('stopped') else 'failed'}"))
                for a in p.get("attempts") or []:  # every execution of this admission: one died, re-runs refused
                    out.append(f"        attempt {a.get('attempt')}: {a.get('outcome')} on {a.get('name') or a.get('worker')}"
                               + (f" devices {_devices(a.get('devices'))}" if a.get("devices") else "")
                               + f", {a.get('seconds', 0):.1f}s")
                for s in p.get("settlements") or []:
                    out.append(f"        {s.get('status')} {s.get('charged', 0):.6f}{_unit(s)} on {s.get('budget')!r}, "
                               f"released {s.get('released', 0):.6f}"
                               + (f", uncovered {s['uncovered']:.6f}" if s.get("uncovered") else ""))
            elif r.kind == "warm-hold":
                out.append(f"  [{r.seq}] IDLE HOLD for warm body {p.get('body')} on {p.get('worker')}: up to "
                           f"{p.get('keep_seconds', 0):.0f} s of its share")
                out.extend(_held_lines(p))
            elif r.kind == "warm-idle":
                out.append(f"  [{r.seq}] IDLE SETTLED for warm body {p.get('body')}: {p.get('seconds', 0):.1f} s"
                           + (f" in {p['periods']} waits between back-to-back runs" if p.get("periods") else "")
                           + f", charged {charged_money(p):.6f} as warm-idle; ended: {p.get('ended') or '?'}")
            elif r.kind == "warm-refused":
                out.append(f"  [{r.seq}] NOT KEPT WARM: body {p.get('body')}: {p.get('reason')}")
            else:
                detail = "; ".join(f"{k}={v}" for k, v in flatten(
                    {k: v for k, v in p.items() if k not in ("request", "task", "flow", "tenant")}))
                out.append(f"  [{r.seq}] {r.kind}: {detail}")
    return "\n".join(out)
