"""A port already taken, said in one line with the fix, before Dask (or uvicorn) fails on it with a traceback."""

from __future__ import annotations

import errno
import socket


def port_in_use(host: str, port: int) -> bool:
    """Whether binding `host:port` fails because something listens there (port 0 never is)."""
    if not port:
        return False
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: a closed port's TIME_WAIT is free
        try:
            sock.bind((host.strip("[]") or "0.0.0.0", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _option(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def taken_scheduler_port(args: list[str]) -> str | None:
    """The first `HOST:PORT` a `dask scheduler` with `args` would listen on that is taken: its port (`--port`,
    default 8786) on `--host`, then its HTTP server (`--dashboard-address`); None when both are free."""
    host = _option(args, "--host") or "0.0.0.0"
    port = _option(args, "--port")
    wanted = [(host, int(port) if port and port.isdigit() else 8786)]
    dashboard = _option(args, "--dashboard-address")
    if dashboard and ":" in dashboard:
        for one in dashboard.split(","):
            h, _, p = one.rpartition(":")
            if p.isdigit():
                wanted.append((h or "0.0.0.0", int(p)))
    for h, p in wanted:
        if port_in_use(h, p):
            return f"{h}:{p}"
    return None
