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
recorded before anything unpickles them; a large result is not on the stream at
all: the reply names where its worker keeps it, and the bytes are fetched from
there (aisched_prefect.flow.direct).
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
from aisched_prefect.flow.client import tls_context
from aisched_prefect.flow.direct import fetch_result, lost_report
from aisched_prefect.errors import (AISchedError, RequestTooLarge, ResultLost,  # noqa: F401 - ResultMismatch: its old home
                                    ResultMismatch, RunLost)
from aisched_prefect.flow.following import Following
from aisched_prefect.wire import FRAME, CallMeta, OutcomesOut, Reply, RunIn, RunsIn, frame, unframe

logger = logging.getLogger("aisched_prefect")

BATCH_SECONDS = 0.005  # calls made this close together travel in one request (a .map())
BATCH_CALLS = 250  # a request's calls are admitted before it answers: small enough to answer in seconds
BATCH_BYTES = 16 * 2**20
POLL_WAIT_SECONDS = 20.0  # one long-poll, below a proxy's idle timeout
FAILOVER_SECONDS = 3.0  # a replica's poll that fails this long sends its calls to another replica
DOWN_SECONDS = 10.0  # a replica that failed is tried last for this long
SUBMITS_AT_ONCE = 4  # runs requests in flight per flow process (the rest wait their turn, not a connection)
REPORT_SECONDS = 10.0  # how long a lost result's report tries the replicas before the task fails without it
SUBMIT_READ_SECONDS = 300.0  # a busy plane may take minutes to admit a request's calls (10,000 shards at once)


PREFECT_SLOTS = 32  # task engines talking to the Prefect API at once (a run waiting on the plane holds none)
END_SECONDS = 20.0  # how long runs still waiting when the flow ends get to record their end in Prefect

ENGINE_SLOT: contextvars.ContextVar["EngineSlot | None"] = contextvars.ContextVar("aisched_engine_slot", default=None)


class EngineSlot:
    """One task engine's turn at the Prefect API. Why: 10,000 engines that each start at once would open as many
    requests to the Prefect server and time out; a run gives its turn back while it waits on the control plane
    (`released`), so the turns bound the Prefect traffic, never how many runs wait."""

    def __init__(self, slots: asyncio.Semaphore) -> None:
        self.slots, self.held = slots, False

    async def acquire(self) -> None:
        if not self.held:
            await self.slots.acquire()
            self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.slots.release()


class LoopThread:
    """One asyncio loop in a daemon thread: where every AI task run of a flow run waits, as a coroutine."""

    def __init__(self, name: str = "aisched-calls") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._client_ctx: Any = None
        self._client_lock: asyncio.Lock | None = None
        self._slots: asyncio.Semaphore | None = None

    def engine_slot(self) -> EngineSlot:
        """A turn at the Prefect API for one task engine on this loop (called on the loop)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(PREFECT_SLOTS)
        return EngineSlot(self._slots)

    async def prefect_client(self) -> Any:
        """One Prefect async client context for every task engine on this loop (entered once, closed with it)."""
        if self._client_ctx is None:
            self._client_lock = self._client_lock or asyncio.Lock()
            async with self._client_lock:
                if self._client_ctx is None:
                    from prefect.context import AsyncClientContext

                    ctx = AsyncClientContext()
                    await ctx.__aenter__()
                    self._client_ctx = ctx
        return self._client_ctx

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
        """Cancel what still waits on the loop and let it end (its task runs end Crashed in Prefect, through the shared
        client, still open), then stop the loop. Left pending, each run was destroyed at exit mid-await, and Prefect's
        engine, logging from the dying coroutine, hung the process in interpreter shutdown."""
        if self.loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(_end_pending(END_SECONDS), self.loop).result(timeout=END_SECONDS + 5)
        except Exception:  # noqa: BLE001 - the loop is stopped below either way
            logger.warning("runs still waiting on the flow's loop did not end within %s s", END_SECONDS, exc_info=True)
        if self._client_ctx is not None:
            ctx, self._client_ctx = self._client_ctx, None
            try:
                asyncio.run_coroutine_threadsafe(ctx.__aexit__(None, None, None), self.loop).result(timeout=10)
            except Exception:
                logger.debug("closing the shared Prefect client failed", exc_info=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


async def _end_pending(seconds: float) -> None:
    """Cancel every other task on this loop and wait up to `seconds` for them to end."""
    me = asyncio.current_task()
    pending = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending, timeout=seconds)


def call_size(meta: CallMeta, fn_bytes: bytes, args_bytes: bytes) -> int:
    """The bytes one call adds to a runs request (its head's share, its function, its arguments)."""
    head = len(RunIn(meta=meta, function=0, args_length=len(args_bytes)).model_dump_json()) + 64
    return head + len(fn_bytes) + len(args_bytes)


def _chain(task: asyncio.Task[Any], out: concurrent.futures.Future[Any]) -> None:
    if task.cancelled():
        out.cancel()
    elif task.exception() is not None:
        out.set_exception(task.exception())  # type: ignore[arg-type]
    else:
        out.set_result(task.result())


class CallLimit:
    """The largest call the plane takes (AISCHED_MAX_CALL_BYTES, as its /v1/whoami says; learnt once per flow
    process). A larger call fails in the flow at once, naming the limit and its setting. Why: the plane answers
    an oversized body 413, but a client still sending 40 MB may see its connection end first and retry for minutes
    as if the plane were down."""

    def __init__(self) -> None:
        self.bytes: int | None = None  # None: unknown (the plane still refuses an oversized call itself)
        self._learnt: asyncio.Future[None] | None = None

    async def check(self, send: Any, meta: CallMeta, fn_bytes: bytes, args_bytes: bytes) -> None:
        if self._learnt is None:
            self._learnt = asyncio.ensure_future(self._learn(send))
        await asyncio.shield(self._learnt)
        size = call_size(meta, fn_bytes, args_bytes)
        if self.bytes is not None and size > self.bytes:
            raise RequestTooLarge("/v1/runs", size, self.bytes, "AISCHED_MAX_CALL_BYTES")

    async def _learn(self, send: Any) -> None:
        try:
            _, resp = await send("GET", "/v1/whoami")
            said = resp.json().get("max_call_bytes")
            self.bytes = said if isinstance(said, int) and said > 0 else None
        except Exception:  # noqa: BLE001 - unknown: the plane still refuses an oversized call itself (413)
            logger.debug("could not learn the control plane's AISCHED_MAX_CALL_BYTES", exc_info=True)


def _http_client(token: str) -> httpx.AsyncClient:
    """A stream's HTTP client. No pool timeout: a request waits for a connection as long as it takes (submits are
    bounded, `SUBMITS_AT_ONCE`, so the long-polls always find one); the process's one TLS context."""
    return httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=POLL_WAIT_SECONDS + 30.0, pool=None),
                             verify=tls_context(), headers={"authorization": f"Bearer {token}"},
                             limits=httpx.Limits(max_connections=16, max_keepalive_connections=8))


class CallStream:
    """A flow process's submit stream and outcome polls, on `LoopThread`'s loop (every method is called there).

    Calls are spread over the control plane's replicas (a batch at a time); each replica that accepted calls of
    this flow process has one long-poll for their outcomes. A replica that stops answering has its calls sent
    again, under the same keys, to another: that one takes them over once the first one's heartbeat lapsed
    (each run is still admitted once and settled once), re-attaches to those it runs, and returns the stored
    reply of those that ended.
    """

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
        self._next = 0  # the replica the next batch goes to first
        self._down: dict[int, float] = {}  # replica -> until when it is skipped (it stopped answering)
        self._accepted_at: dict[str, tuple[int, str]] = {}  # call key -> the replica (and its life) that accepted it
        self._follow = Following()  # replica -> the keys it follows for us, and the life of it that accepted each
        self._after: dict[int, int] = {}  # replica -> the last outcome seq seen from it
        self._pollers: dict[int, asyncio.Task[None]] = {}
        self._sent: dict[str, tuple[CallMeta, bytes, bytes]] = {}  # accepted, not ended: sent again on a takeover
        self._submits: asyncio.Semaphore | None = None
        self.limit = CallLimit()

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = _http_client(self._token)
        return self._http

    async def aclose(self) -> None:
        for poller in self._pollers.values():
            poller.cancel()
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(AISchedError("the runner closed before the run ended"))
        if self._http is not None:
            await self._http.aclose()

    # -- one call ---------------------------------------------------------------------------------
    async def call(self, meta: CallMeta, fn_bytes: bytes, args_bytes: bytes) -> tuple[Reply, bytes]:
        """Submit one call (batched with its neighbours) and wait, as a coroutine, for how it ended."""
        await self.limit.check(self._send, meta, fn_bytes, args_bytes)
        reply = await self._accept(meta, fn_bytes, args_bytes)
        out = b""
        if reply.status != "accepted" and reply.key and reply.key in self._arrived:
            # A submit sent again after a cut: the run ended meanwhile and its outcome came on this process's stream
            # (and was acknowledged) before the plane answered the resent submit ("done", its result delivered).
            reply, out = self._arrived.pop(reply.key)
        elif reply.status == "accepted":
            self._sent[reply.key] = (meta, fn_bytes, args_bytes)
            try:
                reply, out = await self._outcome(reply.key)
            finally:
                self._sent.pop(reply.key, None)
        if reply.status == "completed" and reply.result_ref is not None:  # kept on its worker: fetched from there
            try:
                out = await fetch_result(reply.result_ref, meta.task_name)
            except ResultLost as exc:
                await self._report_lost(reply.key, exc)
                raise
        return reply, out

    async def _report_lost(self, key: str, exc: ResultLost) -> None:
        """Tell the control plane a completed call's result could not be fetched: it files why (a `result-lost`
        record). Best effort: the task run fails with the ResultLost either way."""
        try:
            await self._send("POST", "/v1/results/lost", json=lost_report(key, exc), patience=REPORT_SECONDS)
        except Exception as report:  # noqa: BLE001 - a report that fails must not hide the lost result
            logger.warning("could not tell the control plane that the result of call %s was lost: %s", key, report)

    async def _accept(self, meta: CallMeta, fn_bytes: bytes, args_bytes: bytes) -> Reply:
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[Reply] = loop.create_future()
        self._batch.append((meta, fn_bytes, args_bytes, accepted))
        if len(self._batch) >= BATCH_CALLS:
            self._send_now()
        elif self._flush is None:
            self._flush = loop.call_later(BATCH_SECONDS, self._send_now)
        reply = await accepted
        if reply.status == "accepted" and reply.reason:  # it waits for capacity a scaler starts: say for what
            _flow_log(f"AI task {meta.task_name} {reply.reason}")
        if reply.status == "accepted":
            k, instance = self._accepted_at.pop(reply.key, (0, ""))
            self._follow.accepted(k, reply.key, instance)
            poller = self._pollers.get(k)
            if poller is None or poller.done():
                self._pollers[k] = asyncio.ensure_future(self._poll(k))
        return reply

    async def _outcome(self, key: str) -> tuple[Reply, bytes]:
        if key in self._arrived:
            return self._arrived.pop(key)
        fut = self._waiting.get(key)
        if fut is None or fut.done():
            fut = self._waiting[key] = asyncio.get_running_loop().create_future()
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
        most = min(BATCH_BYTES, self.limit.bytes or BATCH_BYTES)  # a request the plane takes whole
        while batch:
            part, size, functions = [], 0, set()
            while batch and len(part) < BATCH_CALLS:
                meta, fn, args, _ = batch[0]
                grows = call_size(meta, fn, args) - (len(fn) if fn in functions else 0)  # a function travels once
                if part and size + grows > most:
                    break
                part.append(batch.pop(0))
                functions.add(fn)
                size += grows
            asyncio.ensure_future(self._submit(part))

    async def _submit(self, part: list[tuple[CallMeta, bytes, bytes, asyncio.Future[Reply]]],
                      deadline: float | None = None) -> None:
        deadline = deadline if deadline is not None else time.monotonic() + self.retry_seconds
        functions: dict[bytes, int] = {}
        calls: list[RunIn] = []
        for meta, fn, args, _ in part:
            index = functions.setdefault(fn, len(functions))
            calls.append(RunIn(meta=meta, function=index, args_length=len(args)))
        head = RunsIn(session=self.session, functions=[len(f) for f in functions], calls=calls)
        body = frame(head.model_dump_json().encode(), b"".join(functions) + b"".join(a for _, _, a, _ in part))
        first, self._next = self._next, (self._next + 1) % len(self.urls)  # batches are spread over the replicas
        if self._submits is None:
            self._submits = asyncio.Semaphore(SUBMITS_AT_ONCE)
        try:
            async with self._submits:
                k, resp = await self._send("POST", "/v1/runs", first=first, content=body, headers={"content-type": FRAME},
                                           timeout=httpx.Timeout(30.0, read=SUBMIT_READ_SECONDS, pool=None))
            answer = resp.json()
            replies = [Reply.model_validate(r) for r in answer["replies"]]
            instance = str(answer.get("instance") or "")
        except BaseException as exc:  # every call of the batch learns why
            for *_, fut in part:
                if not fut.done():
                    fut.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        if self._follow.seen(k, instance):  # a new life of replica k: its outcome sequence starts again
            self._after[k] = 0
        retry = []
        for item, reply in zip(part, replies):
            if reply.status == "failed" and reply.error_type == "busy":  # in flight on another replica: ask again
                retry.append(item)
            elif not item[3].done():
                if reply.status == "accepted":
                    self._accepted_at[reply.key] = (k, instance)
                item[3].set_result(reply)
        if retry:
            if time.monotonic() > deadline:
                where = "on another replica of the control plane" if len(self.urls) > 1 else f"at {self.urls[0]}"
                for *_, fut in retry:
                    fut.set_exception(AISchedError(f"the call stayed busy {where} for {self.retry_seconds:g}s. "
                                                   "Fix: check the control plane's health and log, then retry the task"))
                return
            await asyncio.sleep(0.5)
            await self._submit(retry, deadline)

    async def _send(self, method: str, path: str, *, first: int = 0, only: int | None = None,
                    patience: float | None = None, **kw: Any) -> tuple[int, httpx.Response]:
        """One request to the first replica that answers (starting at `first`; `only`: that one alone), retried
        while none does (every request is idempotent); returns which replica answered."""
        from aisched_prefect.flow.client import ControlPlaneUnavailable, raise_for_problem

        deadline = time.monotonic() + (self.retry_seconds if patience is None else patience)
        last: Exception | str | None = None
        order = [only] if only is not None else [(first + i) % len(self.urls) for i in range(len(self.urls))]
        while True:
            now = time.monotonic()
            for k in sorted(order, key=lambda k: self._down.get(k, 0) > now):  # replicas that failed go last
                try:
                    resp = await self._client().request(method, self.urls[k] + path, **kw)
                except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError,
                        httpx.ReadTimeout, httpx.PoolTimeout) as exc:
                    last = exc
                    self._down[k] = time.monotonic() + DOWN_SECONDS
                    continue
                if resp.status_code in (502, 503, 504):
                    last = f"HTTP {resp.status_code}"
                    continue
                self._down.pop(k, None)
                raise_for_problem(resp)
                return k, resp
            if time.monotonic() > deadline:
                raise ControlPlaneUnavailable(
                    f"no control plane answered at {', '.join(self.urls[k] for k in order)} ({last}). "
                    "Fix: start it (`aisched serve`) or correct AISCHED_CONTROL_PLANE") from None
            await asyncio.sleep(0.5)

    # -- outcomes ------------------------------------------------------------------------------------
    async def _poll(self, k: int) -> None:
        """The long-poll of replica `k`, while it follows calls of this flow process."""
        from aisched_prefect.flow.client import ControlPlaneUnavailable

        alone = len(self.urls) == 1  # no other replica to go to: wait for this one to come back
        while self._follow.waiting(k):
            asked_at = time.monotonic()
            try:
                _, resp = await self._send("GET", "/v1/outcomes", only=k, patience=None if alone else FAILOVER_SECONDS,
                                           params={"session": self.session, "after": self._after.get(k, 0),
                                                   "instance": self._follow.instance(k), "wait": POLL_WAIT_SECONDS})
                head_bytes, blob = unframe(resp.content)
                head = OutcomesOut.model_validate_json(head_bytes)
            except asyncio.CancelledError:
                raise
            except ControlPlaneUnavailable:  # the replica is gone: its calls go to another one, same keys
                moved = self._follow.take(k)
                if len(self.urls) > 1 and moved:
                    logger.warning("control plane %s stopped answering: sending its %d call(s) to another replica",
                                   self.urls[k], len(moved))
                    await self._resend(moved)
                    continue
                self._fail(moved, ControlPlaneUnavailable(
                    f"the control plane at {self.urls[k]} stopped answering while {len(moved)} AI task run(s) "
                    "waited for it. Fix: start it again (`aisched serve`): runs re-attach by key"))
                return
            except Exception as exc:  # the plane refused the session: the waits end with why
                self._fail(self._follow.take(k), exc)
                return
            restarted, lost = self._follow.answered(k, head.instance, head.pending, len(head.outcomes), asked_at)
            if restarted:  # a new life of k: its outcome sequence starts again
                self._after[k] = 0
            at = 0
            for o in head.outcomes:
                out = blob[at:at + o.length]
                at += o.length
                self._after[k] = max(self._after.get(k, 0), o.seq)
                self._follow.ended(k, o.key)
                lost.discard(o.key)
                self._deliver(o.key, o.reply, out)
            if lost:  # it knows our calls by key, not our session: sent again, they re-attach (or end as filed)
                logger.warning("control plane %s lost %d waiting call(s) (restarted?): sending them again",
                               self.urls[k], len(lost))
                await self._resend(lost)

    def _fail(self, keys: set[str], exc: Exception) -> None:
        for key in keys:
            fut = self._waiting.get(key)
            if fut is not None and not fut.done():
                fut.set_exception(exc)

    async def _resend(self, keys: set[str]) -> None:
        """Send `keys` again under the same keys (each at most `Following.most_resends` times, then it fails as
        RunLost): the plane re-attaches them, takes them over, or answers how they ended."""
        sent: dict[str, tuple[CallMeta, bytes, bytes]] = {}
        for key in keys:
            if key not in self._sent or key in self._arrived:
                continue
            if self._follow.resend(key):
                sent[key] = self._sent[key]
            else:
                self._fail({key}, RunLost(
                    f"the control plane lost AI task run {key} {self._follow.most_resends} times (restarted or "
                    "replaced each time it was sent again): it is not waited for any longer. Fix: check the "
                    "control plane's log for why it restarts, then retry the task (its key makes a run that did "
                    "finish return its filed outcome)"))

        async def again(key: str, meta: CallMeta, fn: bytes, args: bytes) -> None:
            try:
                reply = await self._accept(meta, fn, args)
            except Exception as exc:  # noqa: BLE001 - the wait for this call ends with why
                reply = Reply(status="failed", key=key, error_type=type(exc).__name__,
                              error_message=f"could not re-attach to the call: {exc}")
            if reply.status != "accepted" and key not in self._arrived:  # it ended meanwhile, or was refused
                self._deliver(key, reply, b"")

        await asyncio.gather(*(again(key, *item) for key, item in sent.items()))

    def _deliver(self, key: str, reply: Reply, out: bytes) -> None:
        if (reply.status == "completed" and reply.result_digest and reply.result_ref is None
                and result_digest(out) != reply.result_digest):
            reply = reply.model_copy(update={
                "status": "failed", "error_type": "aisched_prefect.flow.stream.ResultMismatch",
                "error_message": "the result's bytes differ from the digest the control plane recorded: not loaded"})
            out = b""
            logger.error("AI task result for call %s did not match its recorded digest: refused", key)
        fut = self._waiting.get(key)
        if fut is not None and not fut.done():
            fut.set_result((reply, out))
        else:
            self._arrived[key] = (reply, out)


def _flow_log(message: str) -> None:
    """A line in the flow run's log (Prefect's run logger where there is a run context), else this module's log."""
    try:
        from prefect.logging import get_run_logger

        get_run_logger().warning(message)
    except Exception:  # no run context here: the process's log
        logger.warning(message)
