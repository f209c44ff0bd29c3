"""Large results stay on their worker until the caller fetches them: a bounded store and a small HTTP listener.

Why: a result sent back as the Dask task's value travels worker -> the client
that submitted it (the control plane) -> whoever asked for it, and is copied at
each hop. A result of at least `min_bytes` is kept here instead, in the worker
process's memory (never a file a body could read), and the task's value carries
a reference (`ResultRef`): its sha256, its size, where to fetch it and a one-time
token (`secrets.token_urlsafe(32)`, 256 bits). `GET /results/<token>` on the
worker's listener returns the bytes once; a used, expired or unknown token is a
404 (the store is keyed by the token's sha256: a lookup compares no secret byte
by byte). What is kept is bounded in bytes; a result that does not fit goes back
the usual way. Entries expire (by default after the ticket's TTL).

The listener is shared by every run of the worker, and a body on the same host
can connect to it, so no caller may hold it: a connection has `request_seconds`
in all to send its request (not per read: a client that sends a byte every few
seconds is cut at that deadline), one source address holds at most
`max_per_peer` of the `max_connections` slots, and a connection that finds no
free slot takes one from a connection still waiting to send its request: its
own address's oldest when that address is at its share, else the oldest of the
address holding the most. A fetch sends its request as it connects, so it waits
in that state for a round trip; a client that stalls there holds a slot only
until someone needs it.

Settings: dask config `dask-gpu.results.*` (`DASK_DASK_GPU__RESULTS__MIN_BYTES=...`).

>>> store = ResultStore(max_bytes=10)
>>> token = store.put(b"abc", ttl=60)
>>> store.claim(token) == b"abc", store.claim(token)
(True, None)
"""

from __future__ import annotations

import hashlib
import http.server
import io
import logging
import mmap
import secrets
import socket
import threading
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dask_gpu.errors import DaskGPUError

CONFIG_KEY = "dask-gpu.results"
PATH = "/results/"
Held = bytes | mmap.mmap  # a result as bytes, or the sealed memory file its body handed over, mapped read-only
logger = logging.getLogger("distributed.dask_gpu")


class ResultsError(DaskGPUError):
    """The direct-results settings are malformed."""


class ResultSettings(BaseModel):
    """What the operator sets (dask config `dask-gpu.results`)."""

    model_config = ConfigDict(frozen=True)

    enabled: bool = True  # off: every result goes back as the task's value (through the control plane)
    min_bytes: int = Field(default=2**20, ge=1)  # a result at least this large stays on its worker
    max_bytes: int = Field(default=4 * 2**30, ge=0)  # most bytes kept at once; a result that does not fit goes inline
    ttl_seconds: float | None = Field(default=None, gt=0)  # how long a result waits (None: its ticket's TTL)
    host: str | None = None  # where the listener binds and what its URL names (None: the worker's own host)
    max_connections: int = Field(default=16, ge=1, description=(
        "connections served at once, all callers together; past them a new connection takes the slot of one that "
        "has not sent its whole request yet (the address holding the most first, then the oldest), or is closed at "
        "once if every slot is serving a fetch"))
    max_per_peer: int | None = Field(default=None, ge=1, description=(
        "connections one source address holds at once (None: a quarter of max_connections, at least 1), so one "
        "neighbour cannot take every slot"))
    request_seconds: float = Field(default=10.0, gt=0, description=(
        "the whole time a connection has to send its request line and headers, however it trickles them"))
    send_timeout_seconds: float = Field(default=10.0, gt=0, description=(
        "each MiB of a response must be taken by the client within this long, else the connection ends (the result "
        "stays fetchable a while)"))

    def per_peer(self) -> int:
        """How many connections one address may hold at once."""
        return self.max_per_peer or max(1, self.max_connections // 4)


def settings_from_config() -> ResultSettings:
    import dask

    raw = dask.config.get(CONFIG_KEY, default={}) or {}
    values = {str(k).replace("-", "_"): v for k, v in dict(raw).items() if v is not None}
    if "host" in values:
        values["host"] = str(values["host"])
    try:
        return ResultSettings(**values)
    except ValidationError as exc:
        what = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ResultsError(f"dask config {CONFIG_KEY} is malformed: {what}. Fix: e.g. "
                           "DASK_DASK_GPU__RESULTS__MIN_BYTES=1048576, DASK_DASK_GPU__RESULTS__ENABLED=false") from None


class ResultRef(BaseModel):
    """Where a result kept on its worker is fetched once: the task's value in its place."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str  # the worker's listener, http://HOST:PORT (the token is not part of it: the URL may be recorded)
    token: str  # fetch at {url}/results/{token}
    digest: str  # sha256 of the bytes, hex
    size: int
    expires_at: float  # wall clock


def _key(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class ResultStore:
    """Bytes by token: bounded in bytes, each entry taken once or dropped when it expires."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._held: dict[str, tuple[Held, float]] = {}  # sha256(token) -> (bytes, monotonic deadline)
        self._bytes = 0

    def put(self, data: Held, ttl: float) -> str | None:
        """Keep `data` for `ttl` seconds; its token, or None when it does not fit (the caller sends it inline)."""
        token = secrets.token_urlsafe(32)
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            if self._bytes + len(data) > self.max_bytes:
                return None
            self._held[_key(token)] = (data, now + ttl)
            self._bytes += len(data)
        return token

    def claim(self, token: str) -> Held | None:
        """The bytes of `token`, taken out of the store (a second claim finds nothing); None if unknown or expired."""
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            got = self._held.pop(_key(token), None)
            if got is None:
                return None
            self._bytes -= len(got[0])
            return got[0]

    def restore(self, token: str, data: Held, ttl: float) -> None:
        """Put back what a fetch claimed but could not send (the connection broke): the caller may ask again."""
        with self._lock:
            self._held[_key(token)] = (data, time.monotonic() + ttl)
            self._bytes += len(data)

    def _expire(self, now: float) -> None:
        for k in [k for k, (_, deadline) in self._held.items() if deadline < now]:
            self._bytes -= len(self._held.pop(k)[0])

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._expire(time.monotonic())
            return {"results": len(self._held), "bytes": self._bytes}


MAX_HEAD = 8192  # a fetch's request line and headers are far smaller
SEND_CHUNK = 2**20  # a response is sent a MiB at a time, each within `send_timeout_seconds`


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.0"  # one fetch per connection: an idle kept-alive connection holds no slot

    def setup(self) -> None:
        """Read the whole request head before http.server parses it, within one deadline for all of it."""
        super().setup()
        conn: _Conn = self.server.conn_of(self.request)
        head = _read_head(self.connection, conn.since + self.server.settings.request_seconds)  # since its accept
        if head is not None:
            self.server.sent_request(conn)
        self.rfile = io.BytesIO(head or b"")  # nothing, or cut: http.server sees an empty request and closes
        self.connection.settimeout(self.server.settings.send_timeout_seconds)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        token = self.path[len(PATH):] if self.path.startswith(PATH) else ""
        data = self.server.store.claim(token) if 0 < len(token) <= 128 else None
        if data is None:
            self._answer(404, b"no such result (unknown, already fetched, or expired)\n")
            return
        try:
            self.send_response(200)
            self.send_header("content-type", "application/octet-stream")
            self.send_header("content-length", str(len(data)))
            self.send_header("cache-control", "no-store")
            self.end_headers()
            view = memoryview(data)
            for at in range(0, len(view), SEND_CHUNK):  # the send timeout bounds each chunk, not the whole result
                self.wfile.write(view[at:at + SEND_CHUNK])
            self.wfile.flush()
        except OSError:  # not sent: it stays fetchable a while
            self.server.store.restore(token, data, self.server.retry_seconds)

    def do_POST(self) -> None:  # noqa: N802
        self._answer(405, b"GET only\n")

    do_PUT = do_DELETE = do_PATCH = do_HEAD = do_POST  # noqa: N815

    def _answer(self, status: int, text: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - never log a path: it holds a token
        pass


def _read_head(sock: socket.socket, deadline: float) -> bytes | None:
    """The request line and headers (up to the blank line), or None: not all of it by `deadline` (however it was
    trickled), more than MAX_HEAD bytes, or the connection closed or gave its slot up (evicted)."""
    got = b""
    while b"\r\n\r\n" not in got and b"\n\n" not in got:
        left = deadline - time.monotonic()
        if left <= 0 or len(got) > MAX_HEAD:
            return None
        sock.settimeout(left)
        try:
            chunk = sock.recv(4096)
        except OSError:  # the deadline passed, the peer reset, or an eviction shut it down
            return None
        if not chunk:
            return None
        got += chunk
    return got


class _Conn:
    """One accepted connection's slot: its address, since when it waits for its request, and whether it holds it."""

    __slots__ = ("sock", "peer", "since", "pending", "held")

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer, self.since, self.pending, self.held = sock, peer, time.monotonic(), True, True


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # connections waiting to be accepted: a burst is taken (or refused) at once, not dropped
    store: ResultStore
    retry_seconds: float = 60.0

    def __init__(self, address: tuple[str, int], store: ResultStore, settings: ResultSettings) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.store = store
        self.settings = settings
        self._lock = threading.Lock()
        self._conns: dict[int, _Conn] = {}  # id(socket) -> its slot
        self._per_peer: dict[str, int] = {}
        self.refused = 0  # connections closed at once for want of a slot
        self.evicted = 0  # connections that gave their slot up to a newer one
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Give the connection a slot (taking one from a stalling connection if it must), or close it at once: a
        flood of connections costs no thread each."""
        peer = str(client_address[0])
        with self._lock:
            victim = None
            if self._per_peer.get(peer, 0) >= self.settings.per_peer():
                victim = self._stalled(peer) or False
            elif len(self._conns) >= self.settings.max_connections:
                victim = self._stalled(None) or False
            if victim is False:
                self.refused += 1
            else:
                if victim is not None:
                    self._release(victim)
                    self.evicted += 1
                conn = _Conn(request, peer)
                self._conns[id(request)] = conn
                self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        if victim is False:
            self.shutdown_request(request)
            return
        if victim is not None:  # its thread's read ends now; its slot is already this connection's
            try:
                victim.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        super().process_request(request, client_address)

    def _stalled(self, peer: str | None) -> _Conn | None:
        """The connection to give its slot up: one still without its whole request, of `peer` (None: of the address
        holding the most connections), the oldest first; None if every slot serves a fetch."""
        waiting = [c for c in self._conns.values() if c.pending and (peer is None or c.peer == peer)]
        if not waiting:
            return None
        return min(waiting, key=lambda c: (-self._per_peer.get(c.peer, 0), c.since))

    def _release(self, conn: _Conn) -> None:
        if conn.held:
            conn.held = False
            self._conns.pop(id(conn.sock), None)
            left = self._per_peer.get(conn.peer, 1) - 1
            if left > 0:
                self._per_peer[conn.peer] = left
            else:
                self._per_peer.pop(conn.peer, None)

    def conn_of(self, request: Any) -> _Conn:
        with self._lock:
            conn = self._conns.get(id(request))
        if conn is None:  # evicted before its thread began: it holds nothing
            conn = _Conn(request, "?")
            conn.held = conn.pending = False
        return conn

    def sent_request(self, conn: _Conn) -> None:
        """Its request arrived whole: it is a fetch being served, never taken for a stalling one."""
        with self._lock:
            conn.pending = False

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        conn = self.conn_of(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._release(conn)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"connections": len(self._conns), "peers": dict(self._per_peer), "refused": self.refused,
                    "evicted": self.evicted}


class DirectResults:
    """A worker's store and listener for results kept until their caller fetches them."""

    def __init__(self, settings: ResultSettings, host: str) -> None:
        self.settings = settings
        self.store = ResultStore(settings.max_bytes)
        self._server = _Server((settings.host or host, 0), self.store, settings)
        port = self._server.server_address[1]
        name = settings.host or host
        self.base_url = f"http://[{name}]:{port}" if ":" in name else f"http://{name}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="dask-gpu-results", daemon=True)
        self._thread.start()

    def hold(self, data: Held, ttl: float) -> ResultRef | None:
        """A reference to `data`, kept here for `ttl` s (the settings' TTL, if set); None: send it inline (small,
        or the store is full)."""
        if len(data) < self.settings.min_bytes:
            return None
        ttl = self.settings.ttl_seconds or ttl
        digest = hashlib.sha256(data).hexdigest()
        token = self.store.put(data, ttl)
        if token is None:
            logger.warning("a %d-byte result goes back through the control plane: this worker already keeps %s bytes "
                           "of results (dask-gpu.results.max-bytes=%d)", len(data), self.store.stats()["bytes"],
                           self.settings.max_bytes)
            return None
        return ResultRef(url=self.base_url, token=token, digest=digest, size=len(data),
                         expires_at=time.time() + ttl)

    def connections(self) -> dict[str, Any]:
        """The listener's slots now: connections held, per address, and how many were refused or evicted so far."""
        return self._server.stats()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def start(host: str, settings: ResultSettings | None = None) -> DirectResults | None:
    """The worker's direct results, or None where they are off (or the worker has no host to listen on)."""
    settings = settings or settings_from_config()
    if not settings.enabled or not (settings.host or host):
        return None
    return DirectResults(settings, host)
