"""A worker's zygote: one single-threaded process that forks a fresh process for every task body.

Why a zygote and not `fork()` in the worker: a Dask worker is multi-threaded
(event loop, executor threads), and forking it can copy a lock held by another
thread. Why not `multiprocessing`'s forkserver: its preloads are fixed when it
starts, and a body that imports a Prefect flow module would pay that import
(seconds) in every child. The zygote imports the modules a body names before it
forks, once, so each later child starts warm in a few milliseconds.

Each child is its own session (`setsid`), so stopping it kills every
subprocess it started too; it exits when the worker that asked for it dies.

Trust: the zygote only ever imports modules a ticket-checked body named, but
it serves every tenant of this worker, so module-level code of one admitted
body is visible to later ones (as in a Dask worker's own process). Code inside
an admitted body attacking its worker is out of scope (docs/security.md).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
import tempfile
import threading
from typing import Any

_LEN = struct.Struct(">Q")


def send_msg(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    view = bytearray(n)
    mem, got = memoryview(view), 0
    while got < n:
        k = sock.recv_into(mem[got:], n - got)
        if k == 0:
            raise EOFError("peer closed the connection")
        got += k
    return bytes(view)


def recv_msg(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    return recv_exact(sock, n)


def _zygote_main(path: str, worker_pid: int, preload: list[str]) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in preload:
        importlib.import_module(name)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(256)
    imported: set[str] = set()
    while True:
        ready, _, _ = select.select([server], [], [], 1.0)
        if os.getppid() != worker_pid:  # the worker is gone: so is its zygote
            os._exit(0)
        if not ready:
            continue
        conn, _ = server.accept()
        try:
            header = json.loads(recv_msg(conn))
        except (EOFError, ValueError, OSError):
            conn.close()
            continue
        for name in header.get("modules", []):
            if name not in imported and isinstance(name, str):
                imported.add(name)
                try:
                    importlib.import_module(name)
                except BaseException:  # the child reports the failure when it unpickles the body
                    pass
        pid = os.fork()
        if pid == 0:
            server.close()
            os.setsid()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            code = 1
            try:
                from dask_gpu.child import child_main

                code = child_main(conn, worker_pid)
            finally:
                os._exit(code)
        conn.close()


class Zygote:
    """The worker's handle on its zygote process: started lazily, restarted if it died."""

    def __init__(self, preload: tuple[str, ...] = ("cloudpickle", "dask_gpu.child")) -> None:
        self.preload = list(preload)
        self._lock = threading.Lock()
        self._proc: Any = None
        self._dir = tempfile.mkdtemp(prefix="dask-gpu-zygote-")
        self._gen = 0
        self.path = ""

    def _ensure(self) -> str:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return self.path
            import subprocess

            self._gen += 1
            self.path = os.path.join(self._dir, f"z{self._gen}.sock")
            boot = ("import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
                    "from dask_gpu.zygote import _zygote_main; "
                    "_zygote_main(sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))")
            self._proc = subprocess.Popen(
                [sys.executable, "-c", boot, json.dumps([p or os.getcwd() for p in sys.path]), self.path,
                 str(os.getpid()), json.dumps(self.preload)], stdin=subprocess.DEVNULL, close_fds=True)
            return self.path

    def connect(self, modules: list[str], timeout: float = 60.0) -> socket.socket:
        """A connection to a fresh child (forked after importing `modules`)."""
        import time

        path = self._ensure()
        deadline = time.monotonic() + timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if time.monotonic() > deadline or self._proc.poll() is not None:
                    raise RuntimeError("the worker's zygote process did not start; see the worker's log") from None
                time.sleep(0.02)
        send_msg(sock, json.dumps({"modules": modules}).encode())
        return sock

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
            self._proc = None


def wait_readable(sock: socket.socket, seconds: float) -> bool:
    ready, _, _ = select.select([sock], [], [], seconds)
    return bool(ready)


def kill_group(pid: int) -> None:
    """Kill a child and everything it started (its own session)."""
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
            return
        except (ProcessLookupError, PermissionError):
            continue


if __name__ == "__main__":  # pragma: no cover
    sys.exit("dask_gpu.zygote is started by the GPU worker plugin")
