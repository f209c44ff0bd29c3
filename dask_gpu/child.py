"""What runs in the fresh process of one task body: unpickle, check the code, run, send the result back.

The worker never unpickles a body or its result: bytes in, bytes out. The
child checks that the function it unpickled is the code the ticket was issued
for (`code_digest`), so a body cannot be swapped after admission. On an
isolated worker (`run_isolated`) the body's process first gets its own PID and
mount namespaces, working directory, /tmp and GPU nodes, drops to its own UID
and gets an environment of its own, all before it unpickles a byte.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import select
import socket
import threading
import time
import traceback
import types
from typing import Any

from dask_gpu.zygote import recv_msg, send_msg

WORKER_ENV = "DASK_GPU_WORKER"
WORKER_NAME_ENV = "DASK_GPU_WORKER_NAME"
_reports: list[dict[str, Any]] = []


def _norm(value: Any) -> Any:
    """A stable stand-in for a constant (frozensets print in hash order, which varies by process)."""
    if isinstance(value, (frozenset, set)):
        return ("set", sorted(repr(_norm(v)) for v in value))
    if isinstance(value, tuple):
        return tuple(_norm(v) for v in value)
    if isinstance(value, types.CodeType):
        return ("code", _code_bytes(value).hex())
    return value


def _code_bytes(code: types.CodeType) -> bytes:
    h = hashlib.sha256()
    h.update(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_argcount,
                   code.co_kwonlyargcount)).encode())
    h.update(repr(tuple(_norm(c) for c in code.co_consts)).encode())
    return h.digest()


def code_digest(fn: Any) -> str:
    """What will run, as a hash: the function's name, bytecode (nested functions included), default arguments,
    closure values, and what it reads by name from its own module (functions, classes and their methods, plain
    constants), recursively.

    The same function gives the same digest in every process of the same Python:

    >>> def f(x, k=2): return {1, 2} | {x * k}
    >>> code_digest(f) == code_digest(f)
    True
    >>> def g(x, k=3): return {1, 2} | {x * k}
    >>> code_digest(f) != code_digest(g)
    True
    """
    h = hashlib.sha256()
    _feed(h, fn, set(), 0)
    return h.hexdigest()


def _value(value: Any) -> bytes:
    """A process-independent stand-in for a default or closure value (objects by type: their repr holds addresses)."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value).encode()
    if isinstance(value, (tuple, list, frozenset, set)):
        return repr(_norm(tuple(value) if not isinstance(value, (set, frozenset)) else frozenset(value))).encode()
    if isinstance(value, dict):
        return repr(sorted((repr(k), _value(v)) for k, v in value.items())).encode()
    return f"<{type(value).__module__}.{type(value).__qualname__}>".encode()


def _feed(h: Any, fn: Any, seen: set[int], depth: int) -> None:
    fn = getattr(fn, "__wrapped__", fn) if not hasattr(fn, "__code__") else fn
    h.update(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}".encode())
    code = getattr(fn, "__code__", None)
    if code is None or id(fn) in seen or depth > 8:
        return
    seen.add(id(fn))
    h.update(_code_bytes(code))
    for value in (getattr(fn, "__defaults__", None) or ()):
        h.update(_value(value))
    for key, value in sorted((getattr(fn, "__kwdefaults__", None) or {}).items()):
        h.update(key.encode() + _value(value))
    for cell in (getattr(fn, "__closure__", None) or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(value) and hasattr(value, "__code__"):
            _feed(h, value, seen, depth + 1)
        else:
            h.update(_value(value))
    module = getattr(fn, "__module__", None)
    scope = getattr(fn, "__globals__", {})
    for name in _global_names(code):  # what it reads from its own module: changing one changes what runs
        value = scope.get(name)
        if value is None and name not in scope:
            continue
        if isinstance(value, type) and value.__module__ == module and id(value) not in seen:
            seen.add(id(value))
            h.update(f"class {name}".encode())
            for attr, member in sorted(vars(value).items()):
                member = getattr(member, "__func__", member)  # staticmethod, classmethod
                if hasattr(member, "__code__"):
                    _feed(h, member, seen, depth + 1)
                elif not attr.startswith("__"):
                    h.update(attr.encode() + _value(member))
        elif callable(value) and hasattr(value, "__code__"):
            if getattr(value, "__module__", None) == module:
                _feed(h, value, seen, depth + 1)
        elif not isinstance(value, types.ModuleType) and _plain(value):
            h.update(f"{name}=".encode() + _value(value))


def _plain(value: Any) -> bool:
    """Data a body can read as a constant (numbers, text, and containers of them), not an object with identity."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return True
    if isinstance(value, (tuple, list, frozenset, set)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


def _global_names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _global_names(const)
    return sorted(set(names))


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
    """A body never outlives its worker: the worker sends nothing after the body, so its socket turns readable
    only when the worker's end closed (the worker died; it closes only after reading the result)."""
    while True:
        ready, _, _ = select.select([conn], [], [], 0.5)
        if ready:
            try:
                if conn.recv(1, socket.MSG_PEEK) == b"":
                    os._exit(70)
            except OSError:
                os._exit(70)
            time.sleep(0.5)


def child_main(conn: socket.socket, setup: Any = None, announce: bool = True, imports: list[str] = ()) -> int:
    """Run one body. `setup(header)` runs once the body's bytes arrived and before any is unpickled (isolation);
    `imports`: modules its zygote left to it (a flow's own, on an isolated worker), imported once its env is set."""
    import cloudpickle

    if announce:
        send_msg(conn, json.dumps({"pid": os.getpid()}).encode())
    header = json.loads(recv_msg(conn))
    payload = recv_msg(conn)
    if setup is not None:
        try:
            setup(header)
        except BaseException as exc:  # noqa: BLE001 - the worker reports it as this body's error
            out = {"ok": False, "error_type": "dask_gpu.isolation.IsolationError", "error_text": traceback.format_exc(),
                   "error_message": f"the body's process could not be isolated: {type(exc).__name__}: {exc}"}
            send_msg(conn, json.dumps(out).encode())
            send_msg(conn, b"")
            return 1
    threading.Thread(target=_watch_worker, args=(conn,), daemon=True).start()
    os.environ.update(header.get("env", {}))
    for name in imports:
        try:
            __import__(name)
        except BaseException:  # noqa: BLE001 - the body reports it when it unpickles
            pass
    from dask_gpu.execute import _current_devices
    from dask_gpu.inventory import GPUDevice

    _current_devices.set(tuple(GPUDevice(**d) for d in header.get("devices", [])))
    capture = _Capture()
    root = logging.getLogger()
    out: dict[str, Any] = {"ok": False, "error_text": "", "error_type": ""}
    blob = b""
    try:
        stream = io.BytesIO(payload)  # two pickles back to back: the function, then (args, kwargs)
        fn = cloudpickle.load(stream)
        args, kwargs = cloudpickle.load(stream)
        if code_digest(fn) != header.get("code_digest"):
            raise RuntimeError(
                f"the code of {getattr(fn, '__qualname__', fn)!r} on this worker is not the code that was admitted "
                "(its digest differs): deploy the same version of the flow's code to the workers")
        if root.level > logging.INFO or root.level == logging.NOTSET:
            root.setLevel(logging.INFO)
        value = fn(*args, **kwargs)
        blob = cloudpickle.dumps(value)
        out["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - everything a body raises goes back to its caller
        out["error_text"] = traceback.format_exc()
        out["error_type"] = f"{type(exc).__module__}.{type(exc).__qualname__}"
        out["error_message"] = str(exc)
        try:
            blob = cloudpickle.dumps(exc)
        except Exception:
            blob = b""
    out["logs"] = capture.records
    out["reports"] = _reports
    try:
        send_msg(conn, json.dumps(out, default=str).encode())
        send_msg(conn, blob)
    except OSError:
        return 1
    return 0


def run_isolated(conn: socket.socket, header: dict[str, Any], late: list[str], plan: dict[str, Any]) -> int:
    """In the zygote's fresh child (root, inside the tenant's sandbox): give the body a PID namespace of its own.

    This process makes the body's working directory, forks the body as PID 1 of a new PID namespace, tells the
    worker the body's pid (as the worker sees it), waits for it and removes its working directory. The body sets
    up its mounts, drops to its UID, clears its environment and imports the flow's own modules (`late`), then
    runs as any body does.
    """
    import shutil
    import sys

    from dask_gpu.isolation import filesystem, identity

    uid = int(header["uid"])
    workdir = os.path.join(filesystem.BODIES, str(header["workdir"]))
    os.mkdir(workdir, 0o700)
    os.chown(workdir, uid, uid)
    filesystem.unshare(filesystem.CLONE_NEWPID)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()

            def setup(run: dict[str, Any]) -> None:
                filesystem.enter_run(uid, uid, workdir, [int(d["index"]) for d in run.get("devices", [])])
                identity.drop_to(uid, uid)
                os.chdir(filesystem.HOME)
                os.closerange(3, conn.fileno())
                os.closerange(conn.fileno() + 1, 1 << 16)
                os.environ.clear()
                os.environ.update(filesystem.body_env({}, sys.path))

            code = child_main(conn, setup=setup, announce=False, imports=late)
        finally:
            os._exit(code)
    send_msg(conn, json.dumps({"pid": pid}).encode())
    conn.close()
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    shutil.rmtree(workdir, ignore_errors=True)
    return 0
