"""`dask-gpu-scheduler`: `dask scheduler` configured for GPU work the control plane governs.

    dask-gpu-scheduler --tls-dir /etc/aisched/tls --host 0.0.0.0 --port 8786

With `--tls-dir` it speaks only mutual TLS, with the cluster's own CA: on
first start it writes the CA and three certificates there (`scheduler.*` for
itself, `cluster.*` for the workers, `client.*` for the control plane, the one
Dask client: the gate opens the doors that run code to that one only);
later starts reuse them. It preloads `dask_gpu.scheduler_preload`: a task
whose worker dies fails at once (allowed-failures 0), the ticket registry
(each admission ticket runs once cluster-wide) and the cluster's queue.
`--no-tls` runs plain TCP, for a network where every process that can reach
the scheduler is trusted.

It listens where it is told and nowhere else: without `--host` (or
`--interface`) on 127.0.0.1 only (`--host 0.0.0.0` for other hosts to reach
it), and its HTTP server (the dashboard with bokeh installed, and /health,
with or without `--no-dashboard`) on 127.0.0.1:8787 unless
`--dashboard-address` says otherwise. `dask scheduler` would take every
interface for both. Every other option is `dask scheduler`'s own.
"""

from __future__ import annotations

import sys

from dask_gpu.worker_cli import take_option

PRELOAD = "dask_gpu.scheduler_preload"
DASHBOARD = "127.0.0.1:8787"
"""Where the scheduler's HTTP server listens unless --dashboard-address says: it has no authentication."""


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


def main(argv: list[str] | None = None) -> None:
    prog = "dask-gpu-scheduler"
    args = list(sys.argv[1:] if argv is None else argv)
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
    from distributed.cli.dask_scheduler import main as dask_scheduler

    dask_scheduler.main(args=[*listen_defaults(args), "--preload", PRELOAD], prog_name=prog)


if __name__ == "__main__":  # pragma: no cover
    main()
