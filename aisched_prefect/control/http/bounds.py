"""What the HTTP API takes before any route runs: body sizes, and the shape of query parameters.

A refusal here is one a client can read: an oversized body is answered 413 naming the setting after the plane has
read (and dropped) a bounded part of it, so a client still uploading reads the answer instead of a reset
connection; a query parameter out of its range (`wait=nan`, a 10,000-character session id) is a 422 naming the
parameter and what it takes.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from aisched_prefect.errors import RequestTooLarge
from aisched_prefect.wire import Problem

DRAIN_BYTES = 256 * 2**20  # most of a refused body read and dropped so its sender reads the 413 (then: closed)
SESSION_MIN, SESSION_MAX = 16, 64  # a session id's length (a runner's is 32 hex characters)
WAIT_MAX_SECONDS = 3600.0  # a long-poll's `wait` is at most this (each route caps it lower by its own setting)


def call_route(path: str) -> bool:
    """Whether `path` carries AI task calls (their bodies take AISCHED_MAX_CALL_BYTES)."""
    return path in ("/v1/calls", "/v1/runs")


class BodyLimit:
    """Refuse a request body larger than its route takes (413, naming the setting): by its Content-Length before
    any of it is kept, and while it streams in (chunked, or a length that lies), so a 300 MB call never sits in
    the control plane's memory. `/v1/calls` and `/v1/runs` take AISCHED_MAX_CALL_BYTES, every other route
    AISCHED_MAX_REQUEST_BYTES.

    Why drain: a server that answers before reading the body and closes leaves a client still sending it with a
    reset connection (it never reads the 413, and retries as if the plane were down). Up to `DRAIN_BYTES` of the
    body are read and dropped first, so the client reads the answer; a larger body is cut after that bound."""

    def __init__(self, app: Any, settings: Any) -> None:
        self.app = app
        self.calls = (settings.max_call_bytes, "AISCHED_MAX_CALL_BYTES")
        self.other = (settings.max_request_bytes, "AISCHED_MAX_REQUEST_BYTES")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        limit, setting = self.calls if call_route(path) else self.other
        declared = dict(scope.get("headers") or []).get(b"content-length")
        try:
            size = int(declared) if declared is not None else None
        except ValueError:
            size = None
        if size is not None and size > limit:  # refused unkept: drained (bounded), answered, closed
            await _drain(receive, min(size, DRAIN_BYTES))
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


DRAIN_IDLE_SECONDS = 2.0  # a client that announced a body and sends none of it is answered after this


async def _drain(receive: Any, most: int) -> None:
    """Read and drop up to `most` bytes of the request's body (until it ends, the client goes, or it sends nothing
    for DRAIN_IDLE_SECONDS: one that announced 300 MB and waits is answered, not kept waiting for bytes)."""
    import asyncio

    read = 0
    while read < most:
        try:
            message = await asyncio.wait_for(receive(), DRAIN_IDLE_SECONDS)
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request":
            return
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def invalid_parameters(_: Request, exc: RequestValidationError) -> JSONResponse:
    """A request whose parameters or body do not fit their fields: 422 naming the first field and what it takes."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("query", "body", "path"))
    said = first.get("msg", "invalid value")
    fix = f"send {where or 'the request'} as the API reference says ({said.lower()})"
    return JSONResponse(Problem(error=f"invalid {where or 'request'}: {said}. Fix: {fix}", field=where or None,
                                fix=fix).model_dump(), status_code=422)
