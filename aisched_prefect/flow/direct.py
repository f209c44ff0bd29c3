"""Fetching a large result from the worker that kept it, in the flow process: once, checked before it is loaded.

Why: a result that travelled worker -> control plane -> flow was copied twice and
held by the plane meanwhile (a 100 MB result took 5x prefect-dask's time). A
result of at least `dask-gpu.results.min-bytes` stays on its worker
(dask_gpu.worker.results); the control plane records its digest and size in the run's
settlement and hands the flow a `DirectResult`: the worker's listener, a one-time
token, the digest and the size. Here the bytes are fetched with that token and
checked against the digest (and size) before anything unpickles them. The token
goes to the worker only: never the control plane's credential.

>>> import asyncio
>>> from aisched_prefect.wire import DirectResult
>>> ref = DirectResult(url="http://127.0.0.1:9", token="t" * 43, digest="0" * 64, size=1, expires_at=0.0)
>>> try:
...     asyncio.run(fetch_result(ref, "train", attempts=1))
... except ResultLost as exc:
...     print(type(exc).__name__, "Fix:" in str(exc))
ResultLost True
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import time
from urllib.parse import urlsplit

from aisched_prefect.errors import ResultLost, ResultMismatch
from aisched_prefect.wire import DirectResult

ATTEMPTS = 3  # a fetch cut before its bytes arrived is tried again (the worker keeps a result it could not send)
RETRY_SECONDS = 0.5
TIMEOUT_SECONDS = 60.0  # per connect, read or write
FIX_LOST = ("Fix: the run completed and was charged, but its result is gone: retry the task (retries= on the "
            "@ai_task); if the flow process cannot reach the GPU workers' result listeners, an operator turns direct "
            "results off (DASK_DASK_GPU__RESULTS__ENABLED=false on the workers) so results travel through the control "
            "plane")


def _url(ref: DirectResult) -> str:
    return f"{ref.url}/results/{ref.token}"


def _lost(ref: DirectResult, task: str, why: str) -> ResultLost:
    exc = ResultLost(f"the result of AI task {task} could not be fetched from its worker at {ref.url} ({why}). "
                     + FIX_LOST)
    exc.reason = why  # what the control plane is told (`lost_report`): the worker and the call it knows itself
    return exc


def lost_report(key: str, exc: ResultLost) -> dict[str, str]:
    """What a flow tells the control plane (`POST /v1/results/lost`) when a result could not be fetched: the call's
    key and why; the plane files one `result-lost` record about the run (its settlement stays as the run ran).

    >>> lost_report("k", _lost(DirectResult(url="http://h:1", token="t" * 43, digest="0" * 64, size=1,
    ...                                    expires_at=0.0), "train", "HTTP 404"))
    {'key': 'k', 'reason': 'HTTP 404'}
    """
    return {"key": key, "reason": str(getattr(exc, "reason", "") or exc)[:1000]}


def checked(ref: DirectResult, data: bytes, task: str) -> bytes:
    """`data`, if it is the result the control plane recorded (size and sha256); else ResultMismatch, unloaded."""
    if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.digest:
        raise ResultMismatch(
            f"the result of AI task {task} fetched from {ref.url} ({len(data)} bytes) is not the one the control plane "
            f"recorded in its settlement ({ref.size} bytes, sha256 {ref.digest[:16]}...): it was not unpickled. Fix: "
            "nothing to retry blindly: the worker or something between it and this process altered it; check the "
            "worker's host, then retry the task")
    return data


async def fetch_result(ref: DirectResult, task: str, attempts: int = ATTEMPTS) -> bytes:
    """The bytes of a result kept on its worker, checked against the recorded digest before they are returned.

    In a thread of its own, not on the flow's event loop (where every waiting run of the flow process is)."""
    return await asyncio.to_thread(fetch_result_sync, ref, task, attempts)


def fetch_result_sync(ref: DirectResult, task: str, attempts: int = ATTEMPTS) -> bytes:
    """One GET with the stdlib's HTTP client, read straight into one buffer of the announced size.

    Why not httpx (what talks to the control plane): it reads a large body in small chunks through its parser; for
    100 MB from a worker process on this 2-core machine it took 1.2-2.2 s (sync or async) where this takes 0.3-0.5 s.
    No proxy is consulted: the token goes to the worker and nowhere else."""
    where = urlsplit(ref.url)
    last = ""
    for attempt in range(attempts):
        if attempt:
            time.sleep(RETRY_SECONDS * attempt)
        conn = http.client.HTTPConnection(where.hostname or "", where.port, timeout=TIMEOUT_SECONDS)
        try:
            conn.request("GET", f"/results/{ref.token}")
            resp = conn.getresponse()
            if resp.status == 404:
                raise _lost(ref, task, "HTTP 404: the worker holds no such result: already fetched, expired, or the "
                                       "worker restarted")
            if resp.status != 200:
                last = f"HTTP {resp.status}"
                continue
            if resp.length != ref.size:  # not the size the plane recorded: none of it is read (nor held)
                raise ResultMismatch(
                    f"the worker at {ref.url} announced {resp.length} bytes for the result of AI task {task}, not the "
                    f"{ref.size} the control plane recorded in its settlement: nothing of it was read. Fix: check the "
                    "worker's host (something answered for it), then retry the task")
            data = resp.read()  # the announced length, or IncompleteRead
        except (OSError, http.client.HTTPException) as exc:  # refused, cut, timed out: the worker put it back
            last = f"{type(exc).__name__}: {exc}"
            continue
        finally:
            conn.close()
        return checked(ref, data, task)
    raise _lost(ref, task, last or "no answer")
