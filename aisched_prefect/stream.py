"""The flow process's calls to the control plane, as state: one event loop, one submit stream, one outcome poll.

Why: an AI task run may wait hours in the cluster's queue. A blocking request
per run holds a thread and a connection on both sides for all that time, and a
`.map()` over 10,000 shards would hold 10,000 of each. Here every call of the
flow process is a coroutine on one event loop thread (`LoopThread`): calls made
within a few milliseconds of each other go to the control plane as one request
(`POST /v1/runs`, each function's pickle once), and their outcomes come back on
one long-poll (`GET /v1/outcomes`) per flow process, acknowledged by sequence
number so a cut connection or a proxy's idle timeout loses none and delivers
none twice. A result's bytes are checked against the digest the control plane
recorded before anything unpickles them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import threading
import time
import uuid
from collections.abc import Coroutine
from typing import Any

import httpx

from aisched_prefect.control.outcomes import result_digest
from aisched_prefect.errors import AISchedError, InvalidAIRequest
from aisched_prefect.wire import FRAME, CallMeta, OutcomesOut, Reply, RunIn, RunsIn, frame, unframe

logger = logging.getLogger("aisched_prefect")

BATCH_SECONDS = 0.005  # calls made this close together travel in one request (a .map())
BATCH_CALLS = 1000
BATCH_BYTES = 16 * 2**20
POLL_WAIT_SECONDS = 20.0  # one long-poll, below a proxy's idle timeout


class ResultMismatch(AISchedError):
    """A result's bytes are not the ones the control plane recorded: they were not unpickled."""


class LoopThread:
    """One asyncio loop in a daemon thread: where every AI task run of a flow run waits, as a coroutine."""

    def __init__(self, name: str = "aisched-calls") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def start(self, coro: Coroutine[Any, Any, Any], context: contextvars.Context | None = None
              ) -> concurrent.futures.Future[Any]:
        """Run `coro` on the loop (in `context`, e.g. the flow's, copied at submit) and return its future."""
        out: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def begin() -> None:
            task = self.loop.create_task(coro)
            task.add_done_callback(lambda t: _chain(t, out))

        self.loop.call_soon_threadsafe(lambda: (context or contextvars.copy_context()).run(begin))
        return out

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run `coro` on the loop and wait for it here (a direct call of an AI task in the flow's thread)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.run called from its own loop: await the coroutine instead")
        return self.start(coro, contextvars.copy_context()).result()

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


def _chain(task: asyncio.Task[Any], out: concurrent.futures.Future[Any]) -> None:
    if task.cancelled():
        out.cancel()
    elif task.exception() is not None:
        out.set_exception(task.exception())  # type: ignore[arg-type]
    else:
        out.set_result(task.result())


class CallStream:
    """A flow process's submit stream and outcome poll, on `LoopThread`'s loop (every method is called there)."""

    def __init__(self, urls: list[str], token: str, retry_seconds: float = 120.0) -> None:
        self.urls = list(urls)
        self.session = uuid.uuid4().hex
        self.retry_seconds = retry_seconds
        self._token = token
        self._http: httpx.AsyncClient | None = None
        self._batch: list[tuple[CallMeta, bytes, bytes, asyncio.Future[Reply]]] = []
        self._flush: asyncio.TimerHandle | None = None
        self._waiting: dict[str, asyncio.Future[tuple[Reply, bytes]]] = {}
        self._arrived: dict[str, tuple[Reply, bytes]] = {}
        self._after = 0
        self._poller: asyncio.Task[None] | None = None
        self._preferred = 0

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=POLL_WAIT_SECONDS + 30.0),
                                           headers={"authorization": f"Bearer {self._token}"},
                                           limits=httpx.Limits(max_connections=8, max_keepalive_connections=4))
        return self._http

    async def aclose(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(AISchedError("the runner closed before the run ended"))
        if self._http is not None:
            await self._http.aclose()

    # -- one call ---------------------------------------------------------------------------------
    async def call(self, meta: CallMeta, fn_bytes: bytes, args_bytes: bytes) -> tuple[Reply, bytes]:
        """Submit one call (batched with its neighbours) and wait, as a coroutine, for how it ended."""
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[Reply] = loop.create_future()
        self._batch.append((meta, fn_bytes, args_bytes, accepted))
        if len(self._batch) >= BATCH_CALLS:
            self._send_now()
        elif self._flush is None:
            self._flush = loop.call_later(BATCH_SECONDS, self._send_now)
        reply = await accepted
        if reply.status != "accepted":
            return reply, b""
        return await self.outcome(reply.key)

    async def outcome(self, key: str) -> tuple[Reply, bytes]:
        if key in self._arrived:
            return self._arrived.pop(key)
        fut = self._waiting.get(key)
        if fut is None or fut.done():
            fut = self._waiting[key] = asyncio.get_running_loop().create_future()
        if self._poller is None or self._poller.done():
            self._poller = asyncio.ensure_future(self._poll())
        try:
            return await fut
        finally:
            if self._waiting.get(key) is fut:
                del self._waiting[key]

    # -- submitting ---------------------------------------------------------------------------------
    def _send_now(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        batch, self._batch = self._batch, []
        while batch:
            part, size = [], 0
            while batch and len(part) < BATCH_CALLS and (not part or size < BATCH_BYTES):
                item = batch.pop(0)
                part.append(item)
                size += len(item[1]) + len(item[2])
            asyncio.ensure_future(self._submit(part))

    async def _submit(self, part: list[tuple[CallMeta, bytes, bytes, asyncio.Future[Reply]]]) -> None:
        functions: dict[bytes, int] = {}
        calls: list[RunIn] = []
        for meta, fn, args, _ in part:
            index = functions.setdefault(fn, len(functions))
            calls.append(RunIn(meta=meta, function=index, args_length=len(args)))
        head = RunsIn(session=self.session, functions=[len(f) for f in functions], calls=calls)
        body = frame(head.model_dump_json().encode(), b"".join(functions) + b"".join(a for _, _, a, _ in part))
        try:
            resp = await self._send("POST", "/v1/runs", content=body, headers={"content-type": FRAME})
            replies = [Reply.model_validate(r) for r in resp.json()["replies"]]
        except BaseException as exc:  # every call of the batch learns why
            for *_, fut in part:
                if not fut.done():
                    fut.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        retry = []
        for item, reply in zip(part, replies):
            if reply.status == "failed" and reply.error_type == "busy":  # in flight on another replica: ask again
                retry.append(item)
            elif not item[3].done():
                item[3].set_result(reply)
        if retry:
            await asyncio.sleep(0.5)
            await self._submit(retry)

    async def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One request to the first replica that answers, retried while none does (every request is idempotent)."""
        from aisched_prefect.client import ControlPlaneError, ControlPlaneUnavailable

        deadline = time.monotonic() + self.retry_seconds
        last: Exception | str | None = None
        while True:
            for i in range(len(self.urls)):
                k = (self._preferred + i) % len(self.urls)
                try:
                    resp = await self._client().request(method, self.urls[k] + path, **kw)
                except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError,
                        httpx.ReadTimeout, httpx.PoolTimeout) as exc:
                    last = exc
                    continue
                if resp.status_code in (502, 503, 504):
                    last = f"HTTP {resp.status_code}"
                    continue
                self._preferred = k
                if resp.status_code >= 400:
                    try:
                        problem = resp.json()
                    except ValueError:
                        problem = {"error": resp.text or f"HTTP {resp.status_code}"}
                    if resp.status_code == 422:
                        raise InvalidAIRequest(problem.get("error", "invalid request"))
                    raise ControlPlaneError(resp.status_code, problem)
                return resp
            if time.monotonic() > deadline:
                raise ControlPlaneUnavailable(
                    f"no control plane answered at {', '.join(self.urls)} ({last}). "
                    "Fix: start it (`aisched serve`) or correct AISCHED_CONTROL_PLANE") from None
            await asyncio.sleep(0.5)

    # -- outcomes ------------------------------------------------------------------------------------
    async def _poll(self) -> None:
        """The one long-poll of this flow process, while any of its calls waits for its outcome."""
        while self._waiting:
            try:
                resp = await self._send("GET", "/v1/outcomes", params={"session": self.session, "after": self._after,
                                                                       "wait": POLL_WAIT_SECONDS})
                head_bytes, blob = unframe(resp.content)
                head = OutcomesOut.model_validate_json(head_bytes)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the plane refused the session, or is gone past retry_seconds: fail the waits
                for fut in list(self._waiting.values()):
                    if not fut.done():
                        fut.set_exception(exc)
                return
            at = 0
            for o in head.outcomes:
                out = blob[at:at + o.length]
                at += o.length
                self._after = max(self._after, o.seq)
                self._deliver(o.key, o.reply, out)

    def _deliver(self, key: str, reply: Reply, out: bytes) -> None:
        if reply.status == "completed" and reply.result_digest and result_digest(out) != reply.result_digest:
            reply = reply.model_copy(update={
                "status": "failed", "error_type": "aisched_prefect.stream.ResultMismatch",
                "error_message": "the result's bytes differ from the digest the control plane recorded: not loaded"})
            out = b""
            logger.error("AI task result for call %s did not match its recorded digest: refused", key)
        fut = self._waiting.get(key)
        if fut is not None and not fut.done():
            fut.set_result((reply, out))
        else:
            self._arrived[key] = (reply, out)
