"""The control plane's HTTP API (FastAPI, which Prefect already ships): a thin shell over `ControlPlane`'s parts.

Every route authenticates first (`Authorization: Bearer <token>`); what a
caller may do follows from the role its credential proves (flow, approver,
operator). Errors come back as `Problem` JSON naming what was wrong and the fix.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import json
import time
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import anyio
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from pydantic import BaseModel, Field

from aisched_prefect.approvals import ApprovalDecision
from aisched_prefect.control.approvals.page import SECURITY_HEADERS, approval_page, sign_in_page
from aisched_prefect.control.approvals.proof import ApprovalError, LinkHolder
from aisched_prefect.control.approvals.words import budget_left
from aisched_prefect.control.authority.credentials import Unauthorized
from aisched_prefect.control.http.bounds import SESSION_MAX, SESSION_MIN, WAIT_MAX_SECONDS, BodyLimit, invalid_parameters
from aisched_prefect.control.authority.identity import Credential
from aisched_prefect.control.http.prometheus import add_metrics_routes
from aisched_prefect.control.service import ControlPlane
from aisched_prefect.errors import AISchedError, InvalidAIRequest, LedgerUnavailable
from aisched_prefect.ledger.engine import database_errors, described, retryable
from aisched_prefect.settings import Settings
from aisched_prefect.wire import FRAME, CallMeta, OutcomeOut, OutcomesOut, Problem, ResultLostIn, RunsIn, frame, unframe
from blocks import ChainBroken, DelegationRefused

THREADS = 2000  # calls wait (on Dask, on people) in threads: one per call in flight
SESSION_COOKIE = "aisched_session"
SESSION_SECONDS = 8 * 3600.0


class AnswerIn(BaseModel):
    approve: bool
    approver: str = ""
    reason: str = ""
    signature: str = ""
    signed_at: float = 0.0
    items: list[str] = []  # more requests of the same flow run answered together (a signature signs their batch digest)


class LinkIn(BaseModel):
    approver: str


class WithdrawIn(BaseModel):
    reason: str = Field(default="the flow stopped waiting", max_length=500)


class IssueIn(BaseModel):
    principal: str
    tenant: str | None = None
    role: str = "flow"
    expires_in: float | None = None  # seconds from now (None: until revoked); checked at issue
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


def _token(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


_FUNCTIONS: dict[str, bytes] = {}  # recent function pickles by digest: the runs of one .map() share one copy


def _intern(fn: bytes) -> bytes:
    import hashlib

    key = hashlib.sha256(fn).hexdigest()
    kept = _FUNCTIONS.get(key)
    if kept is None:
        if len(_FUNCTIONS) >= 256:
            _FUNCTIONS.pop(next(iter(_FUNCTIONS)))
        kept = _FUNCTIONS[key] = fn
    return kept


def _split_runs(head: RunsIn, blob: bytes) -> list[tuple[CallMeta, tuple[bytes, bytes]]]:
    """Each call's body (its function's pickle and its arguments') out of one runs request's blob."""
    functions, at = [], 0
    for n in head.functions:
        functions.append(_intern(blob[at:at + n]))
        at += n
    out = []
    for c in head.calls:
        if c.function >= len(functions):
            raise ValueError(f"call {c.meta.task_run_id} names function {c.function} of {len(functions)}")
        fn = functions[c.function]
        args = blob[at:at + c.args_length]
        at += c.args_length
        if len(args) != c.args_length:
            raise ValueError("the frame is shorter than its calls say")
        out.append((c.meta.model_copy(update={"args_offset": len(fn)}), (fn, args)))
    if at != len(blob):
        raise ValueError("the frame is longer than its calls say")
    return out


def _form(body: bytes) -> tuple[dict[str, str], dict[str, list[str]]]:
    lists = parse_qs(body.decode(errors="replace"), keep_blank_values=True)
    return {k: v[-1] for k, v in lists.items()}, lists


def _who_sees(viewer: Any) -> tuple[str, str]:
    """How the page names its viewer: (how they are proved, who)."""
    if isinstance(viewer, LinkHolder):
        return ("used-link" if viewer.used else "link"), viewer.principal
    return viewer.role, viewer.principal


class Sessions:
    """Sign-in cookies of the approval page: `<credential id>.<expiry>.<mac>`, the MAC keyed by the control plane's
    signing key (so every replica reads them), checked against the credential as it is now (revoked: signed out)."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self._secret: bytes | None = None

    @property
    def _key(self) -> bytes:
        """Derived from the signing key when first needed (an app over a plane without one serves no pages)."""
        if self._secret is None:
            raw = self.plane.key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
            self._secret = hashlib.sha256(b"aisched-session/1\n" + raw).digest()
        return self._secret

    def _mac(self, body: str) -> str:
        return hmac.new(self._key, body.encode(), hashlib.sha256).hexdigest()

    def make(self, credential_id: str) -> str:
        body = f"{credential_id}.{int(time.time() + SESSION_SECONDS)}"
        return f"{body}.{self._mac(body)}"

    def credential(self, cookie: str) -> Credential | None:
        parts = cookie.split(".")
        if len(parts) != 3 or not parts[1].isdigit() or int(parts[1]) < time.time():
            return None
        if not hmac.compare_digest(parts[2], self._mac(f"{parts[0]}.{parts[1]}")):
            return None
        cred = self.plane.state.snapshot.credentials.get(parts[0]) or self.plane.state.refresh().credentials.get(parts[0])
        return cred if cred is not None and not cred.revoked and cred.role in ("approver", "operator") else None


def _own_origins(request: Request, base_url: str) -> set[str]:
    own = {f"{request.url.scheme}://{request.url.netloc}"}
    if base_url:
        parts = urlsplit(base_url)
        own.add(f"{parts.scheme}://{parts.netloc}")
    return own


def same_site(request: Request, base_url: str = "") -> bool:
    """Whether a POST comes from this control plane's own pages (or from no browser at all): the browser's
    Sec-Fetch-Site, else its Origin, else its Referer must say so. A script without any of them (the CLI, a flow's
    client) is no cross-site request: forging one needs a victim's browser, and browsers send these headers."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site == "same-origin"
    own = _own_origins(request, base_url)
    origin = request.headers.get("origin")
    if origin is not None:
        return origin in own  # "null" (a sandboxed frame, a data: URL) is no origin of ours
    referer = request.headers.get("referer")
    if referer is not None:
        parts = urlsplit(referer)
        return f"{parts.scheme}://{parts.netloc}" in own
    return True


def build_app(plane: ControlPlane) -> FastAPI:
    # No /docs, /redoc or /openapi.json: the API's shape is in docs/reference, not served to any visitor.
    app = FastAPI(title="aisched control plane", docs_url=None, redoc_url=None, openapi_url=None)
    limits = getattr(plane, "settings", None) or Settings()
    app.add_middleware(BodyLimit, settings=limits)
    app.add_exception_handler(RequestValidationError, invalid_parameters)  # type: ignore[arg-type]
    limiter = anyio.CapacityLimiter(THREADS)
    sessions = Sessions(plane)

    @app.middleware("http")
    async def _guard(request: Request, call_next: Any) -> Response:
        """Every POST from another site is refused; every answer carries headers that keep pages out of frames,
        scripts and other sites' referrers."""
        if request.method == "POST" and not same_site(request, getattr(plane, "base_url", "")):
            response: Response = JSONResponse(Problem(
                error="a cross-site request is refused: answer on the control plane's own page",
                fix="open the approval page (its link) and answer there").model_dump(), status_code=403)
        else:
            response = await call_next(request)
        response.headers.update(SECURITY_HEADERS)
        return response

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
    async def health() -> JSONResponse:
        """Alive, and whether the Dask scheduler answers: 503 naming the lost scheduler while it does not."""
        scheduler = plane.scheduler.status()
        body = {"ok": scheduler["connected"], "public_key": plane.public_key, "replica": plane.replica,
                "dask": scheduler["address"], "scheduler": scheduler, "version": plane.version}
        if not scheduler["connected"]:
            body["error"] = (f"the Dask scheduler at {scheduler['address'] or '?'} does not answer"
                             + (f" (for {scheduler['lost_for_seconds']:g}s)" if "lost_for_seconds" in scheduler else "")
                             + ": the control plane keeps reconnecting. Fix: start the scheduler again")
        return JSONResponse(body, status_code=200 if scheduler["connected"] else 503)

    @app.get("/v1/cluster")
    async def cluster(request: Request) -> dict[str, Any]:
        """The cluster as the control plane sees it: workers, devices, which run holds what (operators)."""
        plane.credentials.authenticate(_token(request), "operator")
        return await run(plane.scheduler.cluster_view)

    @app.get("/v1/queue")
    async def queue(request: Request) -> Any:
        """The cluster's queue (runs on GPUs, then waiting runs in serving order), or null without one (operators)."""
        plane.credentials.authenticate(_token(request), "operator")
        return await run(plane.scheduler.queue_view)

    @app.get("/v1/whoami")
    async def whoami(request: Request) -> dict[str, Any]:
        """Who the credential proves, and the largest call this plane takes (a flow refuses a larger one itself)."""
        return {**plane.credentials.authenticate(_token(request)).public(),
                "max_call_bytes": limits.max_call_bytes}

    @app.post("/v1/calls")
    async def call(request: Request) -> Response:
        cred = plane.credentials.authenticate(_token(request), "flow")
        raw = await request.body()
        try:
            meta_bytes, blob = unframe(raw)
            meta = CallMeta.model_validate_json(meta_bytes)
        except ValueError as exc:
            raise InvalidAIRequest(f"malformed call: {exc}") from None
        reply, out = await run(plane.runs.call, cred, meta, blob)
        return Response(frame(reply.model_dump_json().encode(), out), media_type=FRAME)

    @app.post("/v1/runs")
    async def runs(request: Request) -> dict[str, Any]:
        """Many calls in one request (a `.map()`): each is admitted and started; the answer comes at once (accepted,
        or how it ended at admission) and outcomes follow on `GET /v1/outcomes`. No thread waits for any of them."""
        cred = plane.credentials.authenticate(_token(request), "flow")
        raw = await request.body()
        try:
            head_bytes, blob = unframe(raw)
            head = RunsIn.model_validate_json(head_bytes)
            calls = _split_runs(head, blob)
        except ValueError as exc:
            raise InvalidAIRequest(f"malformed runs request: {exc}") from None
        replies = await run(plane.runs.submit_many, cred, head.session, calls)
        return {"replies": [r.model_dump(mode="json") for r in replies], "instance": getattr(plane, "instance", "")}

    @app.get("/v1/outcomes")
    async def outcomes(request: Request, session: str = Query(min_length=SESSION_MIN, max_length=SESSION_MAX),
                       after: int = Query(0, ge=0), wait: float = Query(0.0, ge=0, le=WAIT_MAX_SECONDS),
                       instance: str = Query("", max_length=64)) -> Response:
        """The session's ended calls past `after` (which acknowledges those before it), waiting up to `wait` seconds
        for one: one long-poll per flow process, whatever number of runs it waits for."""
        cred = plane.credentials.authenticate(_token(request), "flow")
        if not plane.outcomes.owns(session, f"{cred.authority}:{cred.principal}"):
            raise Unauthorized("this session belongs to another principal", 403)
        if instance and instance != getattr(plane, "instance", ""):  # `after` counts an earlier life's outcomes
            after = 0
        kept, pending = await plane.outcomes.take(session, f"{cred.authority}:{cred.principal}", after,
                                                  min(wait, plane.settings.outcome_wait_seconds),
                                                  plane.settings.outcome_batch_bytes)
        head = OutcomesOut(outcomes=[OutcomeOut(key=k.key, seq=k.seq, reply=k.reply, length=len(k.out)) for k in kept],
                           pending=pending, replica=plane.replica, instance=getattr(plane, "instance", ""))
        return Response(frame(head.model_dump_json().encode(), b"".join(k.out for k in kept)), media_type=FRAME)

    @app.post("/v1/results/lost")
    async def result_lost(body: ResultLostIn, request: Request) -> dict[str, Any]:
        """A flow could not fetch a completed call's large result from its worker: one `result-lost` record says why
        (its settlement stays as it ran). Only the call's own caller may report it."""
        cred = plane.credentials.authenticate(_token(request), "flow")
        return await run(plane.runs.result_lost, cred, body.key, body.reason)

    @app.get("/v1/approvals")
    async def approvals(request: Request) -> list[dict[str, Any]]:
        """The open requests this caller may see: all (operators), or those an approver may approve."""
        cred = plane.credentials.authenticate(_token(request), "approver", "operator")
        return [v.model_dump(mode="json") for v in await run(plane.approvals.pending)
                if cred.role == "operator" or await run(plane.approvals.may_see, v.id, cred)]

    @app.get("/v1/approvals/{approval_id}")
    async def approval(approval_id: str, request: Request,
                       wait: float = Query(0.0, ge=0, le=WAIT_MAX_SECONDS)) -> dict[str, Any]:
        cred = plane.credentials.authenticate(_token(request))
        approval_id = await run(plane.approvals.resolve, approval_id)
        if cred.role == "approver" and not await run(plane.approvals.may_see, approval_id, cred):
            raise Unauthorized("this approver may not approve this run (no grant with can_approve covers it)", 403)
        return (await run(plane.desk.approval, cred, approval_id, wait)).model_dump(mode="json")

    @app.get("/v1/approvals/{approval_id}/digest")
    async def approval_digest(approval_id: str) -> dict[str, str]:
        """Only what a signed answer signs (`aisched approve --key` without a credential): the request's digest, a
        hash that tells nothing about the run."""
        approval_id = await run(plane.approvals.resolve, approval_id)
        return {"id": approval_id, "digest": (await run(plane.approvals.view, approval_id)).digest}

    @app.post("/v1/approvals/{approval_id}/links")
    async def approval_link(approval_id: str, body: LinkIn, request: Request) -> dict[str, str]:
        """A one-time link for one approver and this request (operators: to hand it over themselves)."""
        plane.credentials.authenticate(_token(request), "operator")
        approval_id = await run(plane.approvals.resolve, approval_id)
        return {"approver": body.approver, "url": await run(plane.approvals.make_link, approval_id, body.approver)}

    @app.post("/v1/approvals/{approval_id}/answer")
    async def answer(approval_id: str, body: AnswerIn, request: Request) -> dict[str, Any]:
        token = _token(request)
        caller = plane.credentials.authenticate(token) if token else None
        approval_id = await run(plane.approvals.resolve, approval_id)
        decision = ApprovalDecision(approved=body.approve, approver=body.approver, reason=body.reason,
                                    channel="signed" if body.signature else "credential", signature=body.signature,
                                    signed_at=body.signed_at)
        return (await run(plane.desk.answer, caller, approval_id, decision, body.items)).model_dump(mode="json")

    @app.post("/v1/approvals/{approval_id}/suspend")
    async def suspend(approval_id: str, request: Request) -> dict[str, Any]:
        cred = plane.credentials.authenticate(_token(request), "flow")
        await run(plane.desk.approval, cred, approval_id)
        return (await run(plane.approvals.suspend, approval_id)).model_dump(mode="json")

    @app.post("/v1/approvals/{approval_id}/withdraw")
    async def withdraw(approval_id: str, body: WithdrawIn, request: Request) -> dict[str, Any]:
        """The flow that asked stops waiting (Ctrl-C, SIGTERM, cancellation): its request ends, its budget is released."""
        cred = plane.credentials.authenticate(_token(request), "flow")
        await run(plane.desk.approval, cred, approval_id)
        return (await run(plane.waiters.withdraw, approval_id, body.reason)).model_dump(mode="json")

    @app.post("/v1/approvals/{approval_id}/unverified")
    async def unverified(approval_id: str, said: dict[str, Any], request: Request) -> dict[str, str]:
        cred = plane.credentials.authenticate(_token(request), "flow")
        await run(plane.desk.approval, cred, approval_id)
        await run(plane.approvals.unverified, approval_id, said)
        return {"recorded": "not counted"}

    def _shown(approval_id: str) -> tuple[dict[str, Any], str, list[dict[str, Any]]]:
        """The request, its budget left after the hold, and the other open requests of its flow run."""
        view = plane.approvals.view(approval_id)
        left = budget_left(plane.approvals.admission(approval_id).holds, view.currency)
        others = plane.approvals.open_batch(approval_id)[1:] if view.status in ("pending", "suspended") else []
        return view.model_dump(mode="json"), left, [o.model_dump(mode="json") for o in others]

    def _viewer(request: Request, approval_id: str, form: dict[str, str] | None = None) -> Credential | LinkHolder | None:
        """Who is looking, proved: a one-time link made for this request (`?link=` or the form's), a sign-in
        cookie, or a Bearer credential (or the form's `token`); None for a visitor without any of them."""
        form = form or {}
        link = form.get("link") or request.query_params.get("link")
        if link:
            return plane.approvals.links.holder(approval_id, link)
        token = form.get("token") or _token(request)
        if token:
            try:
                return plane.credentials.authenticate(token)
            except Unauthorized:
                return None
        return sessions.credential(request.cookies.get(SESSION_COOKIE, ""))

    def _visible(request: Request, approval_id: str, form: dict[str, str] | None = None) -> Any:
        """The viewer if it may see this request, else None (an unknown id looks the same as one it may not see)."""
        viewer = _viewer(request, approval_id, form)
        try:
            return viewer if viewer is not None and plane.approvals.may_see(approval_id, viewer) else None
        except ApprovalError:
            return None

    @app.get("/approve/{approval_id}", response_class=HTMLResponse)
    async def page(approval_id: str, request: Request) -> HTMLResponse:
        """The request, for a visitor who may see it (its link, a sign-in, a credential); a sign-in form otherwise."""
        approval_id = await run(plane.approvals.resolve, approval_id)
        viewer = await run(_visible, request, approval_id)
        if viewer is None:
            return HTMLResponse(sign_in_page(approval_id), status_code=401)
        return HTMLResponse(approval_page(*await run(_shown, approval_id), viewer=_who_sees(viewer),
                                  link=request.query_params.get("link", "") if isinstance(viewer, LinkHolder) else ""))

    @app.post("/approve/{approval_id}/sign-in", response_class=HTMLResponse)
    async def sign_in(approval_id: str, request: Request) -> Response:
        """Sign in once with an approver's (or operator's) credential: a cookie the page then reads (HttpOnly,
        SameSite=Lax, 8 hours, bound to this control plane's key); the credential is never shown or stored."""
        form = _form(await request.body())[0]
        try:
            cred = await run(plane.credentials.authenticate, form.get("token", ""), "approver", "operator")
        except Unauthorized as exc:
            return HTMLResponse(sign_in_page(approval_id, f"Not signed in: {exc}"), status_code=401)
        response = Response(status_code=303, headers={"location": f"/approve/{quote(approval_id, safe='')}"})
        response.set_cookie(SESSION_COOKIE, sessions.make(cred.id), max_age=int(SESSION_SECONDS), httponly=True,
                            samesite="lax", path="/approve",
                            secure=request.url.scheme == "https" or plane.base_url.startswith("https://"))
        return response

    @app.post("/approve/{approval_id}", response_class=HTMLResponse)
    async def page_answer(approval_id: str, request: Request) -> HTMLResponse:
        """The page's form: who answers is who the link, the sign-in or the credential proves (never typed)."""
        form, lists = _form(await request.body())
        approval_id = await run(plane.approvals.resolve, approval_id)
        decision, reason = form.get("decision", ""), form.get("reason", "")
        viewer = await run(_visible, request, approval_id, form)
        if viewer is None:
            who = await run(_viewer, request, approval_id, form)
            if isinstance(who, Credential):  # proved, but may not see it: why, and nothing of the run
                why = await run(plane.approvals.why_not, approval_id, who, ApprovalDecision(
                    approved=decision == "approve", approver=who.principal, reason=reason, channel="credential"))
                return HTMLResponse(sign_in_page(approval_id, f"Not counted: {why}"))
            return HTMLResponse(sign_in_page(approval_id, "Not counted: sign in, or open the link you were sent"), 401)
        items = [i for i in lists.get("item", []) if i != approval_id]  # the others ticked: answered together
        link = form.get("link", "") if isinstance(viewer, LinkHolder) else ""
        try:
            if decision not in ("approve", "reject"):
                raise ApprovalError("choose Approve or Reject")
            if isinstance(viewer, LinkHolder):
                if items:
                    raise ApprovalError("a link answers the one request it was made for: sign in to answer several")
                if viewer.used:
                    raise ApprovalError("this link was used already: it answers once")
            elif viewer.role not in ("approver", "operator"):
                raise ApprovalError(f"a {viewer.role} credential may not do this (needs approver or operator)")
            answer = ApprovalDecision(approved=decision == "approve", approver=viewer.principal, reason=reason,
                                      channel="link" if link else "credential")

            def counted() -> Any:
                if isinstance(viewer, LinkHolder):  # proved first, then spent, then counted: a refusal keeps the link
                    plane.approvals.check(approval_id, answer, viewer)
                    plane.approvals.links.use(viewer)
                return plane.desk.answer(viewer, approval_id, answer, items)  # type: ignore[arg-type]

            view = await run(counted)
            verb = "approved" if decision == "approve" else "rejected"
            count = (f" ({len(view.approved_by)} of {view.approvals_required} approvals)"
                     if view.status in ("pending", "suspended") else "")
            runs = f" {1 + len(items)} runs" if items else ""
            message = f"Recorded: {html.escape(viewer.principal)} {verb}{runs}.{count}"
            if isinstance(viewer, LinkHolder):
                viewer, link = LinkHolder(viewer.principal, viewer.link_id, viewer.approval_id, True), ""
        except (Unauthorized, ApprovalError) as exc:
            message = f"Not counted: {html.escape(str(exc))}"
        return HTMLResponse(approval_page(*await run(_shown, approval_id), message, viewer=_who_sees(viewer), link=link))

    @app.post("/v1/config/{kind}/{name}")
    async def apply(kind: str, name: str, body: dict[str, Any], request: Request) -> dict[str, Any]:
        op = plane.credentials.authenticate(_token(request), "operator")
        applied = await run(plane.configuration.apply, op.principal, kind, name, body)
        return {"kind": applied.kind, "name": applied.name, "version": applied.version, "digest": applied.digest}

    @app.get("/v1/config")
    async def configs(request: Request) -> list[dict[str, Any]]:
        plane.credentials.authenticate(_token(request), "operator")
        return [{"kind": a.kind, "name": a.name, "version": a.version, "digest": a.digest, "body": a.body}
                for a in plane.state.refresh().configs.values()]

    @app.post("/v1/credentials")
    async def issue(body: IssueIn, request: Request) -> dict[str, Any]:
        op = plane.credentials.authenticate(_token(request), "operator")
        tenant = body.tenant or body.principal.split("/")[0]
        token, cred = await run(lambda: plane.credentials.issue(
            op.principal, principal=body.principal, tenant=tenant, role=body.role,  # type: ignore[arg-type]
            expires_in=body.expires_in, authority=body.authority, budget=body.budget, policy=body.policy, cluster=body.cluster))
        return {"token": token, "credential": cred.public()}

    @app.post("/v1/credentials/{credential_id}/revoke")
    async def revoke_credential(credential_id: str, request: Request) -> dict[str, str]:
        op = plane.credentials.authenticate(_token(request), "operator")
        await run(plane.credentials.revoke, op.principal, credential_id)
        return {"revoked": credential_id}

    @app.post("/v1/grants/{parent}/delegate")
    async def delegate(parent: str, body: DelegateIn, request: Request) -> dict[str, Any]:
        caller = plane.credentials.authenticate(_token(request))
        child = await run(lambda: plane.grants.delegate(caller, parent, id=body.id, principal=body.principal,
                                                        authority=body.authority, **body.dimensions))
        return child.model_dump(mode="json")

    @app.post("/v1/grants/{grant_id}/revoke")
    async def revoke(grant_id: str, body: RevokeIn, request: Request) -> dict[str, Any]:
        caller = plane.credentials.authenticate(_token(request))
        return {"revoked": await run(plane.grants.revoke, caller, grant_id, body.reason, body.authority)}

    @app.get("/v1/flow-runs/{flow_run_id}/records")
    async def records(flow_run_id: str, request: Request) -> list[dict[str, Any]]:
        caller = plane.credentials.authenticate(_token(request))
        return [json.loads(r.model_dump_json()) for r in await run(plane.reports.flow_run_records, caller, flow_run_id)]

    @app.post("/v1/flow-runs/{flow_run_id}/usage-artifacts")
    async def usage_artifacts(flow_run_id: str, request: Request) -> dict[str, Any]:
        caller = plane.credentials.authenticate(_token(request), "flow", "operator")
        return await run(plane.reports.publish_usage, caller, flow_run_id)

    @app.post("/v1/checkpoints")
    async def checkpoint(request: Request) -> dict[str, Any]:
        plane.credentials.authenticate(_token(request), "operator")
        return await run(plane.reports.checkpoint)

    add_metrics_routes(app, plane, run)  # /metrics and /metrics/queue for Prometheus (metrics_http.py)
    return app
