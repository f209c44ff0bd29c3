"""A tenant's zygote: one single-threaded process that forks a fresh process for every task body.

Why a zygote and not `fork()` in the worker: a Dask worker is multi-threaded
(event loop, executor threads), and forking it can copy a lock held by another
thread. Why not `multiprocessing`'s forkserver: its preloads are fixed when it
starts, and a body that imports a Prefect flow module would pay that import
(seconds) in every child. The zygote imports the modules a body names before it
forks, once, so each later child starts warm in a few milliseconds.

Nothing one tenant's body does reaches another's: each tenant has a zygote of
its own (the ticket names the tenant), so module-level code a body runs, or a
module it asks for, stays in its tenant's zygote. The zygote has no socket
path at all: the worker talks to it over a socket pair it inherited, and hands
it one end of a fresh pair per body (SCM_RIGHTS), so no other process can
connect to it, find it in /proc or write where it imports from. On an isolated
worker (dask_gpu.isolation) the zygote runs inside a bubblewrap sandbox,
imports only installed packages (a flow's own modules are imported by the body
after it dropped to its own UID), and each body gets its own UID and
namespaces.

Each child is its own session (`setsid`), so stopping it kills every
subprocess it started too; it exits when the worker that asked for it dies
(its socket to the worker closes).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import sys
import threading
from typing import Any


# The worker's own packages: imported by an isolated zygote even from outside site-packages (a checkout on PYTHONPATH).
OWN_PACKAGES = frozenset({"dask_gpu", "aisched_prefect"})


def installed(name: str) -> bool:
    """Whether module `name` is the worker's own code or an installed package, which an isolated zygote may import
    as root: a flow's own module (anything else) is imported by its body, after the body dropped its privileges.

    >>> installed("json"), installed("dask_gpu.body.child"), installed("no_such_module_here")
    (True, True, False)
    """
    import importlib.util
    import sysconfig

    top = name.split(".", 1)[0]
    if top in OWN_PACKAGES or top in sys.builtin_module_names:
        return True
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: finds, never runs, its code
    except (ImportError, ValueError):
        return False
    origin = getattr(spec, "origin", None) if spec is not None else None
    if not origin or origin in ("built-in", "frozen"):
        return spec is not None and origin in ("built-in", "frozen")
    origin = os.path.realpath(origin)
    roots = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return any(origin.startswith(r.rstrip("/") + "/") for r in roots)


def _zygote_main(control_fd: int, preload: list[str], plan: dict[str, Any]) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in preload:
        importlib.import_module(name)
    isolated = bool(plan.get("isolated"))
    control = socket.socket(fileno=control_fd)
    imported: set[str] = set()
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(control, 1 << 16, 4)
        except OSError:
            os._exit(0)
        if not msg:  # the worker is gone: so is its zygote
            os._exit(0)
        conns = [socket.socket(fileno=fd) for fd in fds]
        if len(conns) != 1:
            for c in conns:
                c.close()
            continue
        conn = conns[0]
        try:
            header = json.loads(msg)
        except ValueError:
            conn.close()
            continue
        late: list[str] = []
        for name in header.get("modules", []):
            if not isinstance(name, str) or name in imported:
                continue
            if isolated and not installed(name):
                late.append(name)
                continue
            imported.add(name)
            try:
                importlib.import_module(name)
            except BaseException:  # the child reports the failure when it unpickles the body
                pass
        pid = os.fork()
        if pid == 0:
            control.close()
            os.setsid()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            code = 1
            try:
                from dask_gpu.body.child import child_main, run_isolated

                code = run_isolated(conn, header, late, plan) if isolated else child_main(conn)
            except BaseException:  # before the body's own reporting took over: the worker's log says why
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        conn.close()


class Zygote:
    """The worker's handle on one tenant's zygote process: started lazily, restarted if it died.

    `sandbox`: bwrap's arguments (an isolated worker), the zygote then runs inside that sandbox with an
    environment of its own; None: it runs as the worker's user, with the worker's environment.
    """

    def __init__(self, preload: tuple[str, ...] = ("cloudpickle", "dask_gpu.body.child"), tenant: str = "",
                 sandbox: list[str] | None = None, plan: dict[str, Any] | None = None) -> None:
        self.preload = list(preload)
        self.tenant = tenant
        self.sandbox = sandbox
        self.plan = {"isolated": sandbox is not None, **(plan or {})}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._proc: Any = None
        self._control: socket.socket | None = None

    def _ensure(self) -> socket.socket:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None and self._control is not None:
                return self._control
            import subprocess

            if self._control is not None:
                self._control.close()
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            boot = ("import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
                    "from dask_gpu.worker.zygote import _zygote_main; "
                    "_zygote_main(int(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4]))")
            cmd = [sys.executable, "-c", boot, json.dumps([p or os.getcwd() for p in sys.path]), str(theirs.fileno()),
                   json.dumps(self.preload), json.dumps(self.plan)]
            env = None
            if self.sandbox is not None:
                from dask_gpu.isolation.filesystem import HOME, PATH

                cmd = [*self.sandbox, "--", *cmd]
                # Nothing of the worker's environment, and the home its bodies will have: a package imported here
                # caches paths from it (Prefect's settings: PREFECT_HOME), which a body must be able to reach.
                env = {"PATH": PATH, "LANG": "C.UTF-8", "HOME": HOME, "TMPDIR": "/tmp"}
            self._proc = _spawn(lambda: subprocess.Popen(cmd, stdin=subprocess.DEVNULL, close_fds=True,
                                                         pass_fds=[theirs.fileno()], env=env))
            theirs.close()
            self._control = mine
            return mine

    def connect(self, modules: list[str], run: dict[str, Any] | None = None) -> socket.socket:
        """A connection to a fresh child (forked after importing `modules`); `run`: what an isolated child needs."""
        header = json.dumps({"modules": list(modules), **(run or {})}).encode()
        for attempt in (0, 1):
            control = self._ensure()
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                with self._send_lock:
                    socket.send_fds(control, [header], [theirs.fileno()])
                return mine
            except OSError:
                mine.close()
                if attempt or self._proc.poll() is None:
                    raise RuntimeError("the worker's zygote process did not start; see the worker's log") from None
            finally:
                theirs.close()
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
            if self._control is not None:
                self._control.close()
                self._control = None


_SPAWNER: Any = None
_SPAWNER_LOCK = threading.Lock()


def _spawn(start: Any) -> Any:
    """Run `start()` (a Popen) on one thread that lives as long as this process.

    bwrap's --die-with-parent is PR_SET_PDEATHSIG, which fires when the *thread* that forked bwrap ends, not its
    process: a zygote started from a Dask executor thread (a body's thread, which seceded and ends with its task)
    was SIGKILLed when that task finished, and every body queued in it failed ("ended before it started the
    body"). This thread never ends before the process does.
    """
    global _SPAWNER
    from concurrent.futures import ThreadPoolExecutor

    with _SPAWNER_LOCK:
        if _SPAWNER is None:  # an executor's one thread stays until the interpreter exits (it never idles out)
            _SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dask-gpu-zygote-spawner")
        spawner = _SPAWNER
    return spawner.submit(start).result()


def kill_group(pid: int) -> None:
    """Kill a child and everything it started (its own session)."""
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
            return
        except (ProcessLookupError, PermissionError):
            continue


if __name__ == "__main__":  # pragma: no cover
    sys.exit("dask_gpu.worker.zygote is started by the GPU worker plugin")
