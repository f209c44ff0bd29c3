"""The control plane's HTTP API (FastAPI, which Prefect already ships): a thin shell over `ControlPlane`.

Every route authenticates first (`Authorization: Bearer <token>`); what a
caller may do follows from the role its credential proves (flow, approver,
operator). Errors come back as `Problem` JSON naming what was wrong and the fix.
"""

from __future__ import annotations

import html
import json
import time
from typing import Any
from urllib.parse import parse_qs

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel

from aisched_prefect.approvals import ApprovalDecision
from aisched_prefect.control.approvals import ApprovalError, budget_left
from aisched_prefect.control.service import ControlPlane, Unauthorized
from aisched_prefect.errors import AISchedError, InvalidAIRequest, LedgerUnavailable, RequestTooLarge
from aisched_prefect.ledger.engine import database_errors, described, retryable
from aisched_prefect.settings import Settings
from aisched_prefect.wire import FRAME, CallMeta, Problem, frame, unframe
from blocks import ChainBroken, DelegationRefused

THREADS = 2000  # calls wait (on Dask, on people) in threads: one per call in flight


class AnswerIn(BaseModel):
    approve: bool
    approver: str = ""
    reason: str = ""
    signature: str = ""
    signed_at: float = 0.0
    items: list[str] = []  # more requests of the same flow run answered together (a signature signs their batch digest)


class IssueIn(BaseModel):
    principal: str
    tenant: str | None = None
    role: str = "flow"
    authority: str | None = None
    budget: str | None = None
    policy: str | None = None
    cluster: str | None = None


class DelegateIn(BaseModel):
    id: str
    principal: str
    authority: str | None = None
    dimensions: dict[str, Any] = {}


class RevokeIn(BaseModel):
    reason: str
    authority: str | None = None


class BodyLimit:
    """Refuse a request body larger than its route takes (413, naming the setting): by its Content-Length before
    any of it is read, and while it streams in (chunked, or a length that lies), so a 300 MB call never sits in
    the control plane's memory. `/v1/calls` takes AISCHED_MAX_CALL_BYTES, every other route
    AISCHED_MAX_REQUEST_BYTES."""

    def __init__(self, app: Any, settings: Any) -> None:
        self.app = app
        self.calls = (settings.max_call_bytes, "AISCHED_MAX_CALL_BYTES")
        self.other = (settings.max_request_bytes, "AISCHED_MAX_REQUEST_BYTES")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        limit, setting = self.calls if path == "/v1/calls" else self.other
        declared = dict(scope.get("headers") or []).get(b"content-length")
        try:
            size = int(declared) if declared is not None else None
        except ValueError:
            size = None
        if size is not None and size > limit:  # refused unread; the connection closes after the answer
            text = str(RequestTooLarge(path, size, limit, setting))
            body = json.dumps(Problem(error=text, fix=text.split("Fix: ", 1)[1]).model_dump()).encode()
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        seen = 0

        async def counted() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # raised inside the route's read: answered 413 by the AISchedError handler
                    raise RequestTooLarge(path, None, limit, setting)
            return message

        await self.app(scope, counted, send)


def _token(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


def build_app(plane: ControlPlane) -> FastAPI:
    app = FastAPI(title="aisched control plane", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, settings=getattr(plane, "settings", None) or Settings())
    limiter = anyio.CapacityLimiter(THREADS)

    async def run(fn: Any, *args: Any) -> Any:
        return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)

    @app.exception_handler(AISchedError)
    async def _aisched_error(_: Request, exc: AISchedError) -> JSONResponse:
        status = getattr(exc, "status", 422 if isinstance(exc, InvalidAIRequest) else 400)
        text = str(exc)
        fix = text.split("Fix: ", 1)[1] if "Fix: " in text else ""
        return JSONResponse(Problem(error=text, fix=fix).model_dump(), status_code=status)

    @app.exception_handler(ChainBroken)
    async def _broken(_: Request, exc: ChainBroken) -> JSONResponse:
        return JSONResponse(Problem(error=f"delegation refused (chain): {exc}", field="parent").model_dump(),
                            status_code=403)

    @app.exception_handler(DelegationRefused)
    async def _refused(_: Request, exc: DelegationRefused) -> JSONResponse:
        return JSONResponse(Problem(error=str(exc), field=exc.dimension).model_dump(), status_code=403)

    @app.exception_handler(ValueError)
    async def _bad_value(_: Request, exc: ValueError) -> JSONResponse:
        return JSONResponse(Problem(error=str(exc)).model_dump(), status_code=422)

    async def _database(_: Request, exc: Exception) -> JSONResponse:
        """A database failure that reached the HTTP layer, never a bare 500: a lost or busy database is a 503 with its
        cause (the request can be sent again); anything else names the database's refusal."""
        if retryable(exc):
            text = str(LedgerUnavailable(described(exc)))
            return JSONResponse(Problem(error=text, fix=text.split("Fix: ", 1)[1]).model_dump(), status_code=503)
        fix = "report it with the control plane's log: the control plane should have refused this request itself"
        return JSONResponse(Problem(error=f"the ledger's database refused this request ({described(exc)}). Fix: {fix}",
                                    fix=fix).model_dump(), status_code=500)

    for database_error in database_errors():
        app.add_exception_handler(database_error, _database)

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        return {"ok": True, "public_key": plane.public_key, "replica": plane.replica,
                "dask": plane.client.scheduler.address, "version": plane.version}

    @app.get("/v1/cluster")
    async def cluster(request: Request) -> dict[str, Any]:
        """The cluster as the control plane sees it: workers, devices, which run holds what (operators)."""
        plane.authenticate(_token(request), "operator")
        return await run(plane.cluster_view)

    @app.get("/v1/queue")
    async def queue(request: Request) -> Any:
        """The cluster's queue (runs on GPUs, then waiting runs in serving order), or null without one (operators)."""
        plane.authenticate(_token(request), "operator")
        if not plane.queue:  # `aisched serve --no-queue`: runs go to Dask directly, whatever the scheduler carries
            return None
        return await run(lambda: plane.client.sync(plane.client.scheduler.gpu_queue_status, runs=True))

    @app.get("/v1/whoami")
    async def whoami(request: Request) -> dict[str, Any]:
        return plane.authenticate(_token(request)).public()

    @app.post("/v1/calls")
    async def call(request: Request) -> Response:
        cred = plane.authenticate(_token(request), "flow")
        raw = await request.body()
        try:
            meta_bytes, blob = unframe(raw)
            meta = CallMeta.model_validate_json(meta_bytes)
        except ValueError as exc:
            raise InvalidAIRequest(f"malformed call: {exc}") from None
        reply, out = await run(plane.call, cred, meta, blob)
        return Response(frame(reply.model_dump_json().encode(), out), media_type=FRAME)

    @app.get("/v1/approvals")
    async def approvals(request: Request) -> list[dict[str, Any]]:
        plane.authenticate(_token(request), "approver", "operator")
        return [v.model_dump(mode="json") for v in await run(plane.approvals.pending)]

    @app.get("/v1/approvals/{approval_id}")
    async def approval(approval_id: str, request: Request, wait: float = 0.0) -> dict[str, Any]:
        cred = plane.authenticate(_token(request))
        return (await run(plane.approval, cred, approval_id, wait)).model_dump(mode="json")

    @app.post("/v1/approvals/{approval_id}/answer")
    async def answer(approval_id: str, body: AnswerIn, request: Request) -> dict[str, Any]:
        token = _token(request)
        caller = plane.authenticate(token) if token else None
        decision = ApprovalDecision(approved=body.approve, approver=body.approver, reason=body.reason,
                                    channel="signed" if body.signature else "credential", signature=body.signature,
                                    signed_at=body.signed_at)
        return (await run(plane.answer, caller, approval_id, decision, body.items)).model_dump(mode="json")

    @app.post("/v1/approvals/{approval_id}/suspend")
    async def suspend(approval_id: str, request: Request) -> dict[str, Any]:
        cred = plane.authenticate(_token(request), "flow")
        await run(plane.approval, cred, approval_id)
        return (await run(plane.approvals.suspend, approval_id)).model_dump(mode="json")

    @app.post("/v1/approvals/{approval_id}/unverified")
    async def unverified(approval_id: str, said: dict[str, Any], request: Request) -> dict[str, str]:
        cred = plane.authenticate(_token(request), "flow")
        await run(plane.approval, cred, approval_id)
        await run(plane.approvals.unverified, approval_id, said)
        return {"recorded": "not counted"}

    def _shown(approval_id: str) -> tuple[dict[str, Any], str, list[dict[str, Any]]]:
        """The request, its budget left after the hold, and the other open requests of its flow run."""
        view = plane.approvals.view(approval_id)
        left = budget_left(plane.approvals.admission(approval_id).holds, view.currency)
        others = plane.approvals.open_batch(approval_id)[1:] if view.status in ("pending", "suspended") else []
        return view.model_dump(mode="json"), left, [o.model_dump(mode="json") for o in others]

    @app.get("/approve/{approval_id}", response_class=HTMLResponse)
    async def page(approval_id: str) -> HTMLResponse:
        return HTMLResponse(_page(*await run(_shown, approval_id)))

    @app.post("/approve/{approval_id}", response_class=HTMLResponse)
    async def page_answer(approval_id: str, request: Request) -> HTMLResponse:
        """The page's form: the approver's credential proves who answers (the name is never typed)."""
        lists = parse_qs((await request.body()).decode(), keep_blank_values=True)
        form = {k: v[-1] for k, v in lists.items()}
        token, decision, reason = form.get("token", ""), form.get("decision", ""), form.get("reason", "")
        items = [i for i in lists.get("item", []) if i != approval_id]  # the others ticked: answered together
        try:
            if decision not in ("approve", "reject"):
                raise ApprovalError("choose Approve or Reject")
            caller = await run(plane.authenticate, token, "approver", "operator")
            view = await run(plane.answer, caller, approval_id, ApprovalDecision(
                approved=decision == "approve", approver=caller.principal, reason=reason, channel="credential"), items)
            verb = "approved" if decision == "approve" else "rejected"
            counted = (f" ({len(view.approved_by)} of {view.approvals_required} approvals)"
                       if view.status in ("pending", "suspended") else "")
            runs = f" {1 + len(items)} runs" if items else ""
            message = f"Recorded: {html.escape(caller.principal)} {verb}{runs}.{counted}"
        except (Unauthorized, ApprovalError) as exc:
            message = f"Not counted: {html.escape(str(exc))}"
        return HTMLResponse(_page(*await run(_shown, approval_id), message))

    @app.post("/v1/config/{kind}/{name}")
    async def apply(kind: str, name: str, body: dict[str, Any], request: Request) -> dict[str, Any]:
        op = plane.authenticate(_token(request), "operator")
        applied = await run(plane.apply, op.principal, kind, name, body)
        return {"kind": applied.kind, "name": applied.name, "version": applied.version, "digest": applied.digest}

    @app.get("/v1/config")
    async def configs(request: Request) -> list[dict[str, Any]]:
        plane.authenticate(_token(request), "operator")
        return [{"kind": a.kind, "name": a.name, "version": a.version, "digest": a.digest, "body": a.body}
                for a in plane.state.refresh().configs.values()]

    @app.post("/v1/credentials")
    async def issue(body: IssueIn, request: Request) -> dict[str, Any]:
        op = plane.authenticate(_token(request), "operator")
        tenant = body.tenant or body.principal.split("/")[0]
        token, cred = await run(lambda: plane.issue(
            op.principal, principal=body.principal, tenant=tenant, role=body.role,  # type: ignore[arg-type]
            authority=body.authority, budget=body.budget, policy=body.policy, cluster=body.cluster))
        return {"token": token, "credential": cred.public()}

    @app.post("/v1/credentials/{credential_id}/revoke")
    async def revoke_credential(credential_id: str, request: Request) -> dict[str, str]:
        op = plane.authenticate(_token(request), "operator")
        await run(plane.revoke_credential, op.principal, credential_id)
        return {"revoked": credential_id}

    @app.post("/v1/grants/{parent}/delegate")
    async def delegate(parent: str, body: DelegateIn, request: Request) -> dict[str, Any]:
        caller = plane.authenticate(_token(request))
        child = await run(lambda: plane.delegate(caller, parent, id=body.id, principal=body.principal,
                                                 authority=body.authority, **body.dimensions))
        return child.model_dump(mode="json")

    @app.post("/v1/grants/{grant_id}/revoke")
    async def revoke(grant_id: str, body: RevokeIn, request: Request) -> dict[str, Any]:
        caller = plane.authenticate(_token(request))
        return {"revoked": await run(plane.revoke, caller, grant_id, body.reason, body.authority)}

    @app.get("/v1/flow-runs/{flow_run_id}/records")
    async def records(flow_run_id: str, request: Request) -> list[dict[str, Any]]:
        caller = plane.authenticate(_token(request))
        return [json.loads(r.model_dump_json()) for r in await run(plane.flow_run_records, caller, flow_run_id)]

    @app.post("/v1/flow-runs/{flow_run_id}/usage-artifacts")
    async def usage_artifacts(flow_run_id: str, request: Request) -> dict[str, Any]:
        caller = plane.authenticate(_token(request), "flow", "operator")
        return await run(plane.publish_usage, caller, flow_run_id)

    @app.post("/v1/checkpoints")
    async def checkpoint(request: Request) -> dict[str, Any]:
        plane.authenticate(_token(request), "operator")
        return await run(plane.checkpoint)

    return app


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


def _request(view: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in view["request"].items() if v not in (None, 0, 0.0, False))


def _page(view: dict[str, Any], left: str = "", others: list[dict[str, Any]] | None = None, message: str = "") -> str:
    """The approval page people open from the pause: what is asked, and a form whose credential proves who answers."""
    esc = html.escape
    left_in = max(0, int(view["deadline"] - time.time()))
    req = _request(view)
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(str(v))}</td></tr>" for k, v in (
        ("task", view["task_name"]), ("principal", view["principal"]), ("grant chain", " -> ".join(view["chain"])),
        ("request", req), ("estimated cost", f"{view['est_cost']:.4f} {view['currency']}"),
        ("budget left after the hold", left or "-"), ("rule", view["rule"]),
        ("approvals needed", (f"{view['approvals_required']} different approvers" if view["approvals_required"] > 1
                              else "1") + (", signed only" if view["require_signature"] else "")),
        ("approved by", ", ".join(view["approved_by"]) or "nobody yet")))
    rows += f'<tr><th>status</th><td class="status">{esc(view["status"])}' + (
        f" ({left_in}s left: silence denies)" if view["status"] in ("pending", "suspended") else "") + "</td></tr>"
    rows += f"<tr><th>digest</th><td>{esc(view['digest'])}</td></tr>"  # `aisched approve --key` reads it here
    open_ = view["status"] in ("pending", "suspended")
    batch = ""
    if open_ and others:  # a .map() asks once: the other runs of this flow run waiting, answered together if ticked
        total = view["est_cost"] + sum(o["est_cost"] for o in others)
        items = "".join(
            f'<tr><td><input type="checkbox" name="item" value="{esc(o["id"])}" checked></td><td>{esc(o["id"])}</td>'
            f'<td>{esc(o["task_name"])}</td><td>{esc(_request(o))}</td><td>{o["est_cost"]:.4f} {esc(o["currency"])}</td>'
            f'<td class="digest">{esc(o["digest"][:16])}</td></tr>' for o in others)
        batch = (f"<h2>Also waiting in this flow run</h2><p>Ticked runs are answered with this one "
                 f"({1 + len(others)} runs, {total:.4f} {esc(view['currency'])} together).</p>"
                 f'<table class="batch"><tr><th></th><th>id</th><th>task</th><th>request</th><th>cost</th><th>digest</th></tr>'
                 f"{items}</table>")
    form = "" if not open_ else (
        f'<form method="post">{batch}'
        '<label>Your approver credential <input type="password" name="token" autocomplete="current-password" required>'
        '</label><label>Reason <input type="text" name="reason"></label>'
        '<button name="decision" value="approve" type="submit">Approve</button>'
        '<button name="decision" value="reject" type="submit">Reject</button>'
        '<p class="note">Your answer is recorded under the name your credential proves. The requester cannot approve '
        "its own run, and only approvers whose grants cover this run are counted.</p></form>")
    note = (f'<p class="message{" refused" if message.startswith("Not counted") else ""}">{message}</p>'
            if message else "")
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>Approve {esc(view["task_name"])}</title>'
            f"<style>{_STYLE}</style></head><body><h1>Approve AI task {esc(view['task_name'])}?</h1>{note}"
            f"<table>{rows}</table>{form}</body></html>")
