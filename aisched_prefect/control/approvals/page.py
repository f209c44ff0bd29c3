"""The approval page's HTML: a static page per request (no script, one inline style admitted by its hash), the
sign-in form, and the security headers every response of the control plane carries.

app.py serves it; what it shows comes from the approval book's view of the request.
"""

from __future__ import annotations

import base64
import hashlib
import html
import os
from typing import Any
from urllib.parse import quote

from aisched_prefect.control.approvals.words import duration_in_words, gpus_in_words, time_left, who_may_approve

_STYLE = ("body{font:15px/1.45 system-ui,sans-serif;max-width:46rem;margin:2rem auto;padding:0 1rem;color:#1d2430}"
          "h1{font-size:1.45rem}h2{font-size:1.1rem}table{border-collapse:collapse;width:100%;margin:1rem 0}"
          "th,td{text-align:left;padding:.35rem .6rem;border-bottom:1px solid #e3e6ea;vertical-align:top}"
          "th{width:13rem;white-space:nowrap;color:#5b6573;font-weight:600}td code,.digest{font-family:ui-monospace,monospace;font-size:.85rem;"
          "word-break:break-all}form{background:#f5f7f9;border:1px solid #e3e6ea;border-radius:8px;padding:1rem}"
          "label{display:block;margin:.2rem 0 .8rem;font-weight:600}"
          "input[type=password],input[type=text]{display:block;width:100%;box-sizing:border-box;padding:.45rem;"
          "margin-top:.25rem;font:inherit;border:1px solid #c5ccd4;border-radius:6px}"
          "button{font:inherit;padding:.45rem 1.2rem;border-radius:6px;border:1px solid #c5ccd4;margin-right:.5rem;"
          "cursor:pointer}button[value=approve]{background:#1f6feb;border-color:#1f6feb;color:#fff}"
          ".message{padding:.6rem .8rem;border-radius:6px;background:#eef6ee;border:1px solid #b7dbb9}"
          ".batch th{width:auto}.message.refused{background:#fbeeee;border-color:#e8b4b4}.status{font-weight:600}.note{color:#5b6573;font-size:.9rem}")


_STYLE += (".who{color:#5b6573;margin:.2rem 0 1rem}.signin{max-width:28rem}a{color:#1f6feb}"
           ".left{font-weight:600}")
_STYLE_HASH = base64.b64encode(hashlib.sha256(_STYLE.encode()).digest()).decode()
SECURITY_HEADERS = {
    # No script, no frame, no foreign resource: the pages are static HTML and one inline style (by its hash).
    "content-security-policy": f"default-src 'none'; style-src 'sha256-{_STYLE_HASH}'; form-action 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",  # a page's one-time link never leaves in a Referer
    "x-content-type-options": "nosniff",
    "cache-control": "no-store",
}


def _idle(view: dict[str, Any]) -> str:
    """The idle time the run may leave warm after it, and its price (part of the estimated cost)."""
    seconds, cost = float(view.get("idle_seconds") or 0.0), float(view.get("idle_cost") or 0.0)
    if seconds <= 0:
        return "none (its body ends with the run)"
    return (f"up to {duration_in_words(seconds)} after the run, {cost:.4f} {view['currency']} "
            "(charged only for the time it waits: it ends once nothing of its key waits)")


def _request(view: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in view["request"].items() if v not in (None, 0, 0.0, False))


def prefect_ui() -> str | None:
    """The Prefect UI's address, where the control plane knows it (PREFECT_UI_URL, else PREFECT_API_URL less /api)."""
    ui = os.environ.get("PREFECT_UI_URL") or ""
    if not ui and os.environ.get("PREFECT_API_URL"):
        ui = os.environ["PREFECT_API_URL"].rstrip("/").removesuffix("/api")
    return ui.rstrip("/") or None


def _doc(title: str, body: str) -> str:
    return (f'<!doctype html><html><head><meta charset="utf-8"><meta name="referrer" content="no-referrer">'
            f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>{body}</body></html>")


def sign_in_page(approval_id: str, message: str = "") -> str:
    """What a visitor without a link or credential sees: nothing of the request, a sign-in form."""
    note = f'<p class="message refused">{html.escape(message)}</p>' if message else ""
    return _doc("Approval request", (
        f"<h1>Approval request</h1>{note}<p>Open the link you were sent for this request, or sign in as an approver "
        "who may approve it. Nothing about the run is shown before that.</p>"
        f'<form class="signin" method="post" action="/approve/{quote(approval_id, safe="")}/sign-in">'
        '<label>Approver credential <input type="password" name="token" autocomplete="current-password" required>'
        '</label><button type="submit">Sign in</button></form>'))


def approval_page(view: dict[str, Any], left: str = "", others: list[dict[str, Any]] | None = None, message: str = "", *,
          viewer: tuple[str, str] = ("", ""), link: str = "") -> str:
    """The approval page, for a viewer who may see it: what is asked in words, and (while it is open) a form whose
    link or sign-in proves who answers."""
    esc = html.escape
    how, who = viewer
    req = view["request"]
    open_ = view["status"] in ("pending", "suspended")
    ui = prefect_ui()
    flow_run = (f'<a href="{esc(ui)}/runs/flow-run/{esc(view["flow_run_id"])}" target="_blank" rel="noreferrer">'
                f'{esc(view["flow_run_id"])}</a> (in the Prefect UI)' if ui else esc(view["flow_run_id"]))
    what = req.get("kind", "") + (f" of {req['model']}" if req.get("model") else "")
    runtime = duration_in_words(req["est_seconds"]) if req.get("est_seconds") else ""
    params = view.get("parameters") or {}
    shown_params = ", ".join(f"{k}={v}" for k, v in params.items()) if params else "(none given)"
    rows = [("task", esc(view["task_name"]) + (f" ({esc(what)})" if what else "")), ("flow run", flow_run),
            ("parameters", esc(shown_params) + ' <span class="note">as the flow describes them; the approval binds '
             "the exact arguments by digest</span>"),
            ("GPUs", esc(gpus_in_words(req))), ("expected runtime", esc(runtime or "-")),
            ("estimated cost", esc(f"{view['est_cost']:.4f} {view['currency']}")),
            ("of which warm idle", esc(_idle(view))),
            ("budget left after the hold", esc(left or "-")), ("principal", esc(view["principal"])),
            ("grant chain", esc(" -> ".join(view["chain"]))), ("request", esc(_request(view))),
            ("rule", esc(str(view["rule"]))), ("who may approve", esc(who_may_approve(view.get("approvers") or []))),
            ("approvals needed", esc((f"{view['approvals_required']} different approvers" if view["approvals_required"] > 1
                                      else "1") + (", signed only" if view["require_signature"] else ""))),
            ("approved by", esc(", ".join(view["approved_by"]) or "nobody yet"))]
    status = f'<span class="status">{esc(view["status"])}</span>'
    if open_:
        status += f' <span class="left">{esc(time_left(view["deadline"]))}</span>: silence denies'
    rows.append(("status", status))
    rows.append(("digest", f'<span class="digest">{esc(view["digest"])}</span>'))  # `aisched approve --key` signs it
    table = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    batch = ""
    if open_ and others and how in ("approver", "operator"):  # a .map() asks once: answered together if ticked
        total = view["est_cost"] + sum(o["est_cost"] for o in others)
        items = "".join(
            f'<tr><td><input type="checkbox" name="item" value="{esc(o["id"])}" checked></td><td>{esc(o["id"][:8])}</td>'
            f'<td>{esc(o["task_name"])}</td><td>{esc(gpus_in_words(o["request"]))}</td>'
            f'<td>{o["est_cost"]:.4f} {esc(o["currency"])}</td></tr>' for o in others)
        batch = (f"<h2>Also waiting in this flow run</h2><p>Ticked runs are answered with this one "
                 f"({1 + len(others)} runs, {total:.4f} {esc(view['currency'])} together).</p>"
                 f'<table class="batch"><tr><th></th><th>id</th><th>task</th><th>GPUs</th><th>cost</th></tr>'
                 f"{items}</table>")
    answerable = open_ and how in ("link", "approver", "operator")
    proof = {"link": f"this link was made for {esc(who)} and answers this request once",
             "used-link": f"this link was made for {esc(who)}; it was used",
             "approver": f"signed in as {esc(who)}", "operator": f"signed in as {esc(who)} (operator)",
             "flow": f"the requesting flow's credential ({esc(who)}): it cannot approve"}.get(how, "")
    form = "" if not answerable else (
        f'<form method="post">{batch}'
        + (f'<input type="hidden" name="link" value="{esc(link)}">' if link else "")
        + '<label>Reason <input type="text" name="reason"></label>'
        '<button name="decision" value="approve" type="submit">Approve</button>'
        '<button name="decision" value="reject" type="submit">Reject</button>'
        f'<p class="note">Your answer is recorded as {esc(who)}, as the control plane identified you. The requester '
        "cannot approve its own run, and only approvers whose grants cover this run are counted.</p></form>")
    note = (f'<p class="message{" refused" if message.startswith("Not counted") else ""}">{message}</p>'
            if message else "")
    return _doc(f"Approve {view['task_name']}", f"<h1>Approve AI task {esc(view['task_name'])}?</h1>"
                f'<p class="who">{proof}</p>{note}<table>{table}</table>{form}')
