"""What runs in a body's process: check the code, run one run after another, send each result back.

The worker never unpickles a body or its result: bytes in, bytes out. The
body checks that the code it loaded is the code the ticket was issued for (its
digest: dask_gpu.body.code), so a body cannot be swapped after admission. A body
is *warm*: after a run it waits for the next run its worker sends it (the same
principal and code, on the same devices: the worker sees to that), with its
module state intact, so a model loaded at module level, in a cache or in a
callable class's `__init__` is loaded once per body, not once per run. It ends
when its worker closes its socket (or dies). On an isolated worker
(`run_isolated`) the body's process first gets its own PID and mount
namespaces, working directory, /tmp and GPU nodes, drops to its own UID and
gets an environment of its own, all before it reads a byte of the code.
"""

from __future__ import annotations

import io
import json
import logging
import os
import select
import socket
import threading
import time
import traceback
from typing import Any

from dask_gpu.body.code import code_digest, load, split
from dask_gpu.framing import HANDOFF_FROM, memory_file, recv_msg, send_msg, send_sealed
from dask_gpu.body.time_stop import arm, install

WORKER_ENV = "DASK_GPU_WORKER"
WORKER_NAME_ENV = "DASK_GPU_WORKER_NAME"
_reports: list[dict[str, Any]] = []


def report(item: dict[str, Any]) -> bool:
    """Send something JSON-able back with the result (usage a body reports); False outside a task process."""
    if os.environ.get(WORKER_ENV) is None:
        return False
    _reports.append(dict(item))
    return True


class _Capture:
    """Every record at INFO and above that any logger of this process handles, whatever handlers it has.

    Hooked into `Logger.callHandlers`, not added as a handler: a module the body imports may
    reconfigure logging (Prefect does, with dictConfig) and drop the root's handlers.
    """

    def __init__(self) -> None:
        self.records: list[tuple[int, str]] = []
        original = logging.Logger.callHandlers

        def call_handlers(logger: logging.Logger, record: logging.LogRecord) -> None:
            if record.levelno >= logging.INFO and not record.name.startswith(("distributed", "tornado", "asyncio")):
                try:
                    self.records.append((record.levelno, record.getMessage()))
                except Exception:
                    pass
            original(logger, record)

        logging.Logger.callHandlers = call_handlers  # type: ignore[method-assign]


def _watch_worker(conn: socket.socket) -> None:
    """A body never outlives its worker: while a run goes on the worker sends nothing, so the socket turns
    readable only when the worker's end closed (the worker died, or it ended the body); between runs the next run's
    bytes make it readable too, and the body's own loop reads them."""
    while True:
        ready, _, _ = select.select([conn], [], [], 0.5)
        if ready:
            try:
                if conn.recv(1, socket.MSG_PEEK) == b"":
                    os._exit(70)
            except OSError:
                os._exit(70)
            time.sleep(0.5)


class _Loaded:
    """The code this body has loaded, by digest: loaded (and a callable class constructed) once per body."""

    def __init__(self) -> None:
        self._calls: dict[str, Any] = {}

    def call(self, digest: str, payload: bytes) -> tuple[Any, tuple[Any, ...], dict[str, Any], float]:
        """The callable for `digest` (loaded from `payload` the first time), the run's arguments, and how long
        loading took (0 once loaded: a warm run)."""
        import cloudpickle

        code, offset = split(payload)
        stream = io.BytesIO(payload)
        stream.seek(offset)
        t0 = time.perf_counter()
        fn = self._calls.get(digest)
        if fn is None:
            if code is not None:
                if code.digest() != digest:
                    raise RuntimeError(f"the source of {code.module}.{code.qualname} on this worker is not the code "
                                       "that was admitted (its digest differs): refused")
                fn = load(code)
            else:
                fn = cloudpickle.load(stream)
                if code_digest(fn) != digest:
                    raise RuntimeError(
                        f"the code of {getattr(fn, '__qualname__', fn)!r} on this worker is not the code that was "
                        "admitted (its digest differs): deploy the same version of the flow's code to the workers")
            if isinstance(fn, type):  # a callable class: constructed once per body, called per run (Ray Data's actors)
                fn = fn()
            self._calls[digest] = fn
        elif code is None:
            cloudpickle.load(stream)  # the function again (a warm run): skipped, the loaded one runs
        args, kwargs = cloudpickle.load(stream)
        return fn, args, kwargs, time.perf_counter() - t0


def _name_unreached_path(out: dict[str, Any], data: list[str], tenant: str) -> None:
    """An isolated body that failed to reach a path it was not given: its error says which path and which setting."""
    import re

    found = re.search(r"(?:PermissionError|FileNotFoundError|IsADirectoryError|NotADirectoryError).*?'(/[^']*)'",
                      out.get("error_text", ""))
    if found is None:
        return
    path = found.group(1)
    if any(path == p or path.startswith(p.rstrip("/") + "/") for p in data):
        return
    given = ", ".join(data) or "none"
    out["error_message"] = (f"{out.get('error_message', '')} ({path} is not among the paths this worker gives tenant "
                            f"{tenant or '(none)'}'s bodies: {given}. Fix: the operator adds it with dask-gpu-worker "
                            f"--tenant-path {tenant or 'TENANT'}={os.path.dirname(path) or path} (dask config "
                            "dask-gpu.isolation.tenant-paths), or pass the data on a path already given)")


from dask_gpu.body.limit_names import name_the_limit  # noqa: E402 - imports nothing that holds a key


class Sealed:
    """A result pickled into a memory file of this body's (its descriptor and size): handed to the worker whole."""

    __slots__ = ("fd", "size")

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size


def _pickled(value: Any) -> bytes | Sealed:
    """`value` pickled: bytes, or (HANDOFF_FROM bytes and more) a memory file the worker maps instead of reading the
    bytes through the socket. Pickled straight into that file: a 100 MB result is written once, not pickled into
    bytes and then copied (which also held it twice in the body's memory)."""
    import cloudpickle

    try:
        fd = memory_file()
    except OSError:  # no memfd here (a seccomp filter, an old kernel): bytes through the socket
        return cloudpickle.dumps(value)
    try:
        with open(fd, "wb", closefd=False) as f:
            cloudpickle.dump(value, f)
            size = f.tell()
        if size >= HANDOFF_FROM:
            sealed = Sealed(fd, size)
            fd = -1  # the caller closes it once handed over
            return sealed
        data = bytearray()
        while len(data) < size:
            chunk = os.pread(fd, size - len(data), len(data))
            if not chunk:
                break
            data += chunk
        return bytes(data)
    finally:
        if fd >= 0:
            os.close(fd)


def _run_one(loaded: _Loaded, header: dict[str, Any], payload: bytes,
             capture: _Capture) -> tuple[dict[str, Any], bytes | Sealed]:
    """One run in this body: its environment and devices, its code (loaded once per body), its result."""
    import cloudpickle

    from dask_gpu.body.current import current_devices_var
    from dask_gpu.inventory import GPUDevice

    os.environ.update(header.get("env", {}))
    current_devices_var.set(tuple(GPUDevice(**d) for d in header.get("devices", [])))
    arm()  # SIGTERM (a time limit) makes its checkpoint() raise StopRequested
    capture.records = []
    _reports.clear()
    root = logging.getLogger()
    out: dict[str, Any] = {"ok": False, "error_text": "", "error_type": "", "setup_seconds": 0.0}
    blob = b""
    try:
        fn, args, kwargs, out["setup_seconds"] = loaded.call(str(header.get("code_digest")), payload)
        if root.level > logging.INFO or root.level == logging.NOTSET:
            root.setLevel(logging.INFO)
        value = fn(*args, **kwargs)
        blob = _pickled(value)
        out["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - everything a body raises goes back to its caller
        out["error_text"] = traceback.format_exc()
        out["error_type"] = f"{type(exc).__module__}.{type(exc).__qualname__}"
        out["error_message"] = str(exc)
        exc = name_the_limit(out, exc)  # a fork bomb's EAGAIN says "PIDs", not "Resource temporarily unavailable"
        try:
            blob = cloudpickle.dumps(exc)
        except Exception:
            blob = b""
    out["logs"] = capture.records
    out["reports"] = list(_reports)
    return out, blob


def child_main(conn: socket.socket, setup: Any = None, announce: bool = True, imports: list[str] = (),
               data: list[str] | None = None, tenant: str = "") -> int:
    """Run bodies' runs until the worker closes the socket. `setup(header)` runs once the first run's bytes arrived
    and before any is read (isolation); `imports`: modules its zygote left to it (a flow's own, on an isolated
    worker), imported once its environment is set."""
    install()
    if announce:
        send_msg(conn, json.dumps({"pid": os.getpid()}).encode())
    loaded, capture, runs = _Loaded(), None, 0
    while True:
        try:
            header = json.loads(recv_msg(conn))
            payload = recv_msg(conn)
        except (EOFError, OSError, ValueError):  # the worker ended this body (or died)
            return 0
        if runs == 0:
            if setup is not None:
                try:
                    setup(header)
                except BaseException as exc:  # noqa: BLE001 - the worker reports it as this body's error
                    out = {"ok": False, "error_type": "dask_gpu.isolation.IsolationError",
                           "error_text": traceback.format_exc(),
                           "error_message": f"the body's process could not be isolated: {type(exc).__name__}: {exc}"}
                    send_msg(conn, json.dumps(out).encode())
                    send_msg(conn, b"")
                    return 1
            threading.Thread(target=_watch_worker, args=(conn,), daemon=True).start()
            os.environ.update(header.get("env", {}))
            for name in imports:
                try:
                    __import__(name)
                except BaseException:  # noqa: BLE001 - the body reports it when it loads its code
                    pass
            capture = _Capture()
        runs += 1
        assert capture is not None
        out, blob = _run_one(loaded, header, payload, capture)
        out["runs"] = runs
        if data is not None and not out["ok"]:
            _name_unreached_path(out, data, tenant)
        try:
            if isinstance(blob, Sealed):
                out["sealed"] = True
            send_msg(conn, json.dumps(out, default=str).encode())
            if isinstance(blob, Sealed):
                send_sealed(conn, blob.fd, blob.size)
            else:
                send_msg(conn, blob)
        except OSError:
            return 1
        finally:
            if isinstance(blob, Sealed):
                os.close(blob.fd)


def run_isolated(conn: socket.socket, header: dict[str, Any], late: list[str], plan: dict[str, Any]) -> int:
    """In the zygote's fresh child (root, inside the tenant's sandbox): give the body a PID namespace of its own.

    This process makes the body's working directory and network namespace (unless the worker said `host`: a
    multi-host gang's member), forks the body as PID 1 of a new PID namespace, tells the
    worker the body's pid (as the worker sees it), waits for it and removes its working directory. The body sets
    up its mounts, drops to its UID, clears its environment and imports the flow's own modules (`late`), then
    runs as any body does.
    """
    import sys

    from dask_gpu.isolation import filesystem, identity, syscalls
    from dask_gpu.isolation.cleanup import remove_tree

    uid = int(header["uid"])
    workdir = os.path.join(filesystem.BODIES, str(header["workdir"]))
    os.mkdir(workdir, 0o700)
    os.chown(workdir, uid, uid)
    if header.get("network", "host") != "host":  # its own loopback: nobody's abstract sockets or listeners but its own
        from dask_gpu.isolation import network

        network.enter_own()
    filesystem.unshare(filesystem.CLONE_NEWPID)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()

            def setup(run: dict[str, Any]) -> None:
                filesystem.enter_run(uid, uid, workdir, [int(d["index"]) for d in run.get("devices", [])],
                                     tmp_bytes=header.get("tmp_bytes"))
                group = header.get("group")
                identity.drop_to(uid, uid, [int(group)] if group else [])
                syscalls.deny_keyrings()  # the kernel's per-UID keyrings outlive a body: none may be made
                os.chdir(filesystem.HOME)
                os.closerange(3, conn.fileno())
                os.closerange(conn.fileno() + 1, 1 << 16)
                os.environ.clear()
                os.environ.update(filesystem.body_env({}, sys.path))

            code = child_main(conn, setup=setup, announce=False, imports=late,
                              data=[p[:-3] if p.endswith(":ro") else p for p in header.get("data") or []],
                              tenant=str(header.get("tenant") or ""))
        finally:
            os._exit(code)
    send_msg(conn, json.dumps({"pid": pid}).encode())
    conn.close()
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    try:
        remove_tree(workdir)  # iterative, never follows a link (shutil.rmtree recurses: a deep tree outlived its run)
    except OSError:
        pass  # its worker removes it too, as the body ends
    return 0
