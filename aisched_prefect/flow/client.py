"""The flow process's side of the boundary: an HTTP client of the control plane, and nothing it could abuse.

It holds one credential (the token an operator issued) and the addresses of
the control plane's replicas. It cannot reach the ledger, the signing key or
the Dask cluster; what it sends is a request and opaque bytes, and what it
gets back is a decision and opaque bytes.
"""

from __future__ import annotations

import functools
import logging
import ssl
import time
from typing import Any

import httpx

from aisched_prefect.errors import ConfigurationError, CredentialRefused, InvalidAIRequest, RequestTooLarge, SetupError
from aisched_prefect.wire import FRAME, ApprovalView, CallMeta, Reply, frame, unframe

logger = logging.getLogger("aisched_prefect")


FIRST_CONTACT_SECONDS = 5.0
"""How long a flow's first request (who its credential proves) waits for a control plane before it says none answers:
a plane that is up answers at once, and a user who mistyped an address hears it in seconds, not minutes."""


class ControlPlaneUnavailable(SetupError):
    """No replica of the control plane answered."""


class ControlPlaneError(SetupError):
    """The control plane refused a request; the message says what to fix."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        self.status, self.problem = status, problem
        super().__init__(problem.get("error", f"HTTP {status}"))


def raise_for_problem(resp: httpx.Response) -> None:
    """An answer of 400 or more as the named error it is: the request's own (422), or the plane's refusal."""
    if resp.status_code < 400:
        return
    try:
        problem = resp.json()
    except ValueError:
        problem = {"error": resp.text or f"HTTP {resp.status_code}"}
    if resp.status_code == 422:
        raise InvalidAIRequest(problem.get("error", "invalid request"))
    if resp.status_code == 413:  # the named limit and its setting, as the plane said them
        raise RequestTooLarge.answered(problem.get("error", "") or "the control plane refused a request as too large "
                                       "(HTTP 413). Fix: send less, or pass large data by reference")
    raise ControlPlaneError(resp.status_code, problem)


@functools.lru_cache(maxsize=1)
def tls_context() -> ssl.SSLContext:
    """The one TLS context this process's clients of the control plane share: the CAs httpx's default reads (the
    system's, or SSL_CERT_FILE's and SSL_CERT_DIR's), loaded once. Each client made its own, and loading the CA bundle
    cost 17-44 ms of CPU twice a flow run, for a control plane most often reached over plain HTTP on 127.0.0.1."""
    return httpx.create_ssl_context()


class ControlPlaneClient:
    """Calls one of several replicas; a replica that does not answer is skipped (the call is retried, idempotently)."""

    def __init__(self, urls: list[str], token: str, timeout: float = 30.0, retry_seconds: float = 30.0) -> None:
        if not urls:
            raise ConfigurationError("no control plane address: set AISCHED_CONTROL_PLANE or pass control_plane=")
        self.urls = list(urls)
        self._token = token
        self._preferred = 0
        self.retry_seconds = retry_seconds
        self._http = httpx.Client(timeout=httpx.Timeout(timeout, read=None), verify=tls_context(),
                                  headers={"authorization": f"Bearer {token}"} if token else {},  # a signed answer needs none
                                  limits=httpx.Limits(max_connections=2000, max_keepalive_connections=256))

    def close(self) -> None:
        self._http.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a control-plane client holds a credential: it is never pickled")

    def _send(self, method: str, path: str, *, rotate: bool = False, retry_seconds: float | None = None,
              **kw: Any) -> httpx.Response:
        """One request, to the first replica that answers; a replica that goes away, or answers busy (409: the
        same call runs on another replica), is retried until `retry_seconds`. Every request is idempotent: a
        call carries its key, so sending it again never runs it twice. `rotate`: start at the next replica
        (calls are spread over the replicas)."""
        deadline = time.monotonic() + (self.retry_seconds if retry_seconds is None else retry_seconds)
        last: Exception | str | None = None
        if rotate:
            self._preferred = (self._preferred + 1) % len(self.urls)
        while True:
            for i in range(len(self.urls)):
                k = (self._preferred + i) % len(self.urls)
                try:
                    resp = self._http.request(method, self.urls[k] + path, **kw)
                except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
                    last = exc
                    continue
                if resp.status_code == 409 and "the client retries" in resp.text:  # Busy: in flight, ask again
                    last = ("busy on another replica" if len(self.urls) > 1
                            else "busy: the control plane was still admitting or running it")
                    break
                self._preferred = k
                raise_for_problem(resp)
                return resp
            if time.monotonic() > deadline:
                raise ControlPlaneUnavailable(
                    f"no control plane answered at {', '.join(self.urls)} ({last}). "
                    "Fix: start it (`aisched serve`) or correct AISCHED_CONTROL_PLANE") from None
            time.sleep(0.5)

    def get(self, path: str, **kw: Any) -> Any:
        return self._send("GET", path, **kw).json()

    def post(self, path: str, body: Any = None, **kw: Any) -> Any:
        return self._send("POST", path, json=body, **kw).json()

    # -- calls ----------------------------------------------------------------------------------
    def call(self, meta: CallMeta, blob: bytes) -> tuple[Reply, bytes]:
        resp = self._send("POST", "/v1/calls", rotate=True, retry_seconds=max(self.retry_seconds, 120.0),
                          content=frame(meta.model_dump_json().encode(), blob), headers={"content-type": FRAME})
        head, out = unframe(resp.content)
        reply = Reply.model_validate_json(head)
        if reply.status == "completed" and reply.result_ref is not None:  # kept on its worker: fetched from there
            from aisched_prefect.flow.direct import fetch_result_sync, lost_report
            from aisched_prefect.errors import ResultLost

            try:
                out = fetch_result_sync(reply.result_ref, meta.task_name)
            except ResultLost as exc:  # the control plane files why (best effort: the call fails with it either way)
                try:
                    self._send("POST", "/v1/results/lost", json=lost_report(reply.key, exc), retry_seconds=10.0)
                except Exception as report:  # noqa: BLE001
                    logger.warning("could not tell the control plane that the result of call %s was lost: %s",
                                   reply.key, report)
                raise
        return reply, out

    def approval(self, approval_id: str, wait: float = 0.0) -> ApprovalView:
        return ApprovalView.model_validate(self.get(f"/v1/approvals/{approval_id}", params={"wait": wait}))

    def whoami(self, first: bool = False) -> dict[str, Any]:
        """Who the credential proves. `first`: the flow's first contact, so a plane that does not answer is said within
        `FIRST_CONTACT_SECONDS`, and a refused credential is a `CredentialRefused` naming the setting and the fix."""
        if not first:
            return self.get("/v1/whoami")
        try:
            # Unreachable (refused, no route, no answer to connect) is said within seconds; a plane that accepted
            # the connection is up, and on a loaded host may take a while to answer.
            return self.get("/v1/whoami", retry_seconds=FIRST_CONTACT_SECONDS,
                            timeout=httpx.Timeout(60.0, connect=FIRST_CONTACT_SECONDS))
        except httpx.TimeoutException as exc:
            raise ControlPlaneUnavailable(
                f"no control plane answered at {', '.join(self.urls)} ({type(exc).__name__}: it took longer than "
                f"{FIRST_CONTACT_SECONDS:g}s). Fix: start it (`aisched serve`) or correct AISCHED_CONTROL_PLANE") from None
        except ControlPlaneError as exc:
            if exc.status not in (401, 403):
                raise
            said = str(exc).split(". Fix:", 1)[0].rstrip(".")
            raise CredentialRefused(
                f"the control plane at {', '.join(self.urls)} refused the flow's credential (AISCHED_TOKEN): {said}. "
                "Fix: set AISCHED_TOKEN to a flow credential an operator issued for you (aisched credentials issue "
                "PRINCIPAL --authority ... --budget ...), or point AISCHED_CONTROL_PLANE at the plane that issued it") from None
