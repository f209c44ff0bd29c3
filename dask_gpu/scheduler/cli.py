"""`dask-gpu-scheduler`: `dask scheduler` configured for GPU work the control plane governs.

    dask-gpu-scheduler --tls-dir /etc/aisched/tls --host 0.0.0.0 --port 8786

With `--tls-dir` it speaks only mutual TLS, with the cluster's own CA: on
first start it writes the CA and three certificates there (`scheduler.*` for
itself, `cluster.*` for the workers, `client.*` for the control plane, the one
Dask client: the gate opens the doors that run code to that one only);
later starts reuse them. It preloads `dask_gpu.scheduler.preload`: a task
whose worker dies fails at once (allowed-failures 0), the ticket registry
(each admission ticket runs once cluster-wide) and the cluster's queue.
`--no-tls` runs plain TCP, for a network where every process that can reach
the scheduler is trusted.

It listens where it is told and nowhere else: without `--host` (or
`--interface`) on 127.0.0.1 only (`--host 0.0.0.0` for other hosts to reach
it), and its HTTP server on 127.0.0.1:8787 unless `--dashboard-address` says
otherwise. `dask scheduler` would take every interface for both.

Its HTTP server answers `/health` and nothing else: Dask's other routes
(`/info`, `/json`, `/metrics`, `/eventstream`, the proxy, the bokeh dashboard)
show every task's key, the workers and the logs to whoever reaches the port,
without a login or a certificate. `--dashboard` turns them on (Dask's
`distributed.scheduler.http.routes`, and the bokeh dashboard where it is
installed), on this host's loopback only: a `--dashboard-address` that is not
a loopback address is refused with it (reach it through an SSH tunnel).
`--jupyter` (a Python server for whoever reaches that port) is refused. Every
other option is `dask scheduler`'s own.
"""

from __future__ import annotations

import sys

from dask_gpu.worker.cli import take_option, wants_help

PRELOAD = "dask_gpu.scheduler.preload"
SCHEDULER_OPTIONS = """\
dask-gpu-scheduler's own options (before Dask's, which follow):
  --tls-dir DIR                   mutual TLS with the cluster's own CA, written there on first start (or --no-tls)
  --no-tls                        plain TCP, where everyone who can reach the scheduler is trusted
  --dashboard                     serve Dask's dashboard and routes (loopback only); else /health only
  --host / --dashboard-address    default 127.0.0.1 and 127.0.0.1:8787 (Dask's default is every interface)
"""
DASHBOARD = "127.0.0.1:8787"
"""Where the scheduler's HTTP server listens unless --dashboard-address says: it has no authentication."""
ROUTES_KEY = "distributed.scheduler.http.routes"
HEALTH_ONLY = ("distributed.http.health",)
"""The scheduler's HTTP routes unless the operator turns the dashboard on: Dask's others serve the task keys."""


def listen_defaults(args: list[str]) -> list[str]:
    """`--host 127.0.0.1` and `--dashboard-address 127.0.0.1:8787` where neither (nor `--interface`) was given."""
    def given(*names: str) -> bool:
        return any(a == n or a.startswith(n + "=") for a in args for n in names)

    out = list(args)
    if not given("--host", "--interface"):
        out += ["--host", "127.0.0.1"]
    if not given("--dashboard-address"):
        out += ["--dashboard-address", DASHBOARD]
    return out


def _option_value(args: list[str], name: str) -> str | None:
    """The value of the last `name VALUE` / `name=VALUE` in `args` (None: not given)."""
    found = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith(name + "="):
            found = a.split("=", 1)[1]
    return found


def is_loopback(address: str) -> bool:
    """Whether every host of a `--dashboard-address` (HOST:PORT[,HOST:PORT...]) is a loopback address.

    >>> [is_loopback(a) for a in ("127.0.0.1:8787", "localhost:0", ":8787", "8787", "0.0.0.0:8787", "10.0.0.5:8787")]
    [True, True, False, False, False, False]
    """
    import ipaddress

    hosts = [part.rsplit(":", 1)[0] if ":" in part else "" for part in address.split(",")]
    for host in hosts:
        if host == "localhost":
            continue
        try:
            if not ipaddress.ip_address(host.strip("[]")).is_loopback:
                return False
        except ValueError:  # "" (every interface, or the scheduler's host) or a name: not loopback for sure
            return False
    return bool(hosts)


def http_options(args: list[str], prog: str) -> bool:
    """Take `--dashboard`/`--no-dashboard` from `args` (after `listen_defaults`): whether the operator turned the
    dashboard on. Refuses it on an address beyond loopback, and `--jupyter` always (one line each, with the fix)."""
    on = "--dashboard" in args
    if on and "--no-dashboard" in args:
        sys.exit(f"{prog}: --dashboard and --no-dashboard were both given; give one")
    args[:] = [a for a in args if a not in ("--dashboard", "--no-dashboard")]
    if "--jupyter" in args:
        sys.exit(f"{prog}: --jupyter serves a Python server to whoever reaches the HTTP port, without a login: it is "
                 "not offered. Fix: leave --jupyter out")
    address = _option_value(args, "--dashboard-address") or DASHBOARD
    if on and not is_loopback(address):
        sys.exit(f"{prog}: --dashboard shows every task, worker and log without a login, so it listens on this "
                 f"host's loopback only, not --dashboard-address {address}. Fix: --dashboard-address {DASHBOARD} "
                 f"and an SSH tunnel (ssh -L 8787:{DASHBOARD} SCHEDULER-HOST), or leave --dashboard out "
                 "(/health only, on any address)")
    return on


def main(argv: list[str] | None = None) -> None:
    prog = "dask-gpu-scheduler"
    args = list(sys.argv[1:] if argv is None else argv)
    if wants_help(args):  # the project's options first, then `dask scheduler`'s own
        print(SCHEDULER_OPTIONS)
        from distributed.cli.dask_scheduler import main as dask_scheduler

        dask_scheduler.main(args=["--help"], prog_name=prog)
    tls_dir = take_option(args, "--tls-dir", prog, "/etc/aisched/tls")
    plain = "--no-tls" in args
    if plain:
        args.remove("--no-tls")
    if bool(tls_dir) == plain:
        sys.exit(f"{prog}: pass --tls-dir DIR (mutual TLS with the cluster's own CA: only the control plane may "
                 "connect as a client), or --no-tls on a network where everyone who can reach the scheduler is trusted")
    if tls_dir:
        from dask_gpu.security import ClusterTLS

        tls = ClusterTLS.load_or_create(tls_dir[0])
        d = tls.directory
        args += ["--protocol", "tls", "--tls-ca-file", str(d / "ca.pem"), "--tls-cert", str(d / "scheduler.pem"),
                 "--tls-key", str(d / "scheduler.key")]
        print(f"{prog}: TLS files in {d}: workers need ca.pem, cluster.pem, cluster.key (dask-gpu-worker --tls-dir); "
              "the control plane needs ca.pem, client.pem, client.key (aisched serve --dask-tls)", file=sys.stderr,
              flush=True)
    args = listen_defaults(args)
    dashboard = http_options(args, prog)
    address = _option_value(args, "--dashboard-address")
    if dashboard:
        print(f"{prog}: HTTP on {address}: the dashboard, /info, /json, /metrics and /health (--dashboard; no login: "
              "loopback only)", file=sys.stderr, flush=True)
    else:
        import dask

        dask.config.set({ROUTES_KEY: list(HEALTH_ONLY)})  # whatever a dask config file says: this is the scheduler
        print(f"{prog}: HTTP on {address}: /health only (--dashboard for Dask's dashboard and routes, on loopback)",
              file=sys.stderr, flush=True)
    from dask_gpu.ports import taken_scheduler_port

    taken = taken_scheduler_port(args)
    if taken is not None:
        sys.exit(f"{prog}: {taken} is in use (another scheduler, or another program, listens there). Fix: stop it, "
                 "or choose free ports (--port N, --dashboard-address 127.0.0.1:M) and give workers and the control "
                 "plane the new address")
    from distributed.cli.dask_scheduler import main as dask_scheduler

    dask_scheduler.main(args=[*args, "--dashboard" if dashboard else "--no-dashboard", "--preload", PRELOAD],
                        prog_name=prog)


if __name__ == "__main__":  # pragma: no cover
    main()
