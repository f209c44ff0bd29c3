"""`dask-gpu-worker`: `dask worker` with the GPU preload, for hosts that join an existing scheduler.

    dask-gpu-worker tls://scheduler:8786 --tls-dir /etc/aisched/tls --trust-key KEY
    dask-gpu-worker tls://scheduler:8786 --tls-dir /etc/aisched/tls --trust-key KEY \\
        --declared "4 GPUs, 24 GB, L4"                                 # no NVML: declare them

`--trust-key` (repeatable; DASK_GPU_TRUSTED_KEYS) is the control plane's public
key, as `aisched serve` prints it: the worker runs only bodies whose ticket it
signed. `--tls-dir` is a directory with the cluster's `ca.pem`, `cluster.pem`
and `cluster.key` (what `dask-gpu-scheduler --tls-dir` writes). Without
`--host` (or `--listen-address`, `--interface`) the worker, its nanny and their
HTTP servers listen only on this host's address that reaches the scheduler
(127.0.0.1 for a scheduler on this machine), not on every interface as `dask
worker` does.

The tenant boundary (dask_gpu.isolation; dask config `dask-gpu.isolation.*`):

    --isolation auto|isolated|unisolated|shared   auto (default): isolated when run as root with bubblewrap
    --body-uids 20000-20999                        the UIDs bodies run under (isolated)
    --tenant NAME                                  serve this tenant's bodies only (required where the
                                                   worker does not isolate: it refuses to start without it)
    --device-nodes DIR                             where this host's nvidia* device nodes are (default /dev)
    --network pasta|none|host                      each isolated body's own network namespace: outbound through
                                                   pasta (default), none (loopback only), or the host's namespace
    --tenant-path TENANT=PATH[:ro][,PATH...]       host paths TENANT's bodies may reach (isolated: bound into its
                                                   sandbox at the same path; once per tenant)
    --tenant-group TENANT=GID                      the group TENANT's bodies run with (isolated: the group that
                                                   owns the team's shared storage; once per tenant)

Inside a Slurm job (SLURM_JOB_ID set) it advertises only the job's GPUs (SLURM_JOB_GPUS), typed by the job's
GRES, with the job id (dask_gpu.slurm.allocation), and `--isolation auto` serves one tenant (`--tenant`, required).

Every other option is `dask worker`'s own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from dask_gpu.errors import InventorySpecError
from dask_gpu.inventory import DECLARED_ENV, discover
from dask_gpu.tickets import TRUSTED_KEYS_ENV, TicketRejected, parse_trusted_keys

PRELOAD = "dask_gpu.worker.preload"
NANNY_PRELOAD = "dask_gpu.worker.nanny_preload"  # the gate on the nanny too: its `run` executes code


def take_option(args: list[str], name: str, prog: str, example: str, many: bool = False) -> list[str]:
    """Remove every `name VALUE` (and `name=VALUE`) from `args`; return the values."""
    values, i = [], 0
    while i < len(args):
        if args[i] == name:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                sys.exit(f"{prog}: {name} needs a value, e.g. {name} {example}")
            values.append(args[i + 1])
            del args[i : i + 2]
        elif args[i].startswith(name + "="):
            values.append(args[i].split("=", 1)[1])
            del args[i]
        else:
            i += 1
    if len(values) > 1 and not many:
        sys.exit(f"{prog}: {name} was given {len(values)} times; give it once")
    return values


def tls_files(directory: str, party: str, prog: str) -> dict[str, str]:
    """The CA and `party`'s certificate and key in `directory`, checked to exist."""
    d = Path(directory)
    files = {"ca": d / "ca.pem", "cert": d / f"{party}.pem", "key": d / f"{party}.key"}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        sys.exit(f"{prog}: --tls-dir {directory}: missing {', '.join(missing)}. Fix: copy ca.pem, {party}.pem and "
                 f"{party}.key from the directory `dask-gpu-scheduler --tls-dir` wrote")
    return {k: str(v) for k, v in files.items()}


ISOLATION_FLAGS = {"--isolation": ("mode", "isolated"), "--tenant": ("tenant", "team-a"),
                   "--body-uids": ("body_uids", "20000-20999"), "--device-nodes": ("device_nodes", "/dev"),
                   "--tenant-path": ("tenant_paths", "team-a=/srv/data/team-a"),
                   "--tenant-group": ("tenant_groups", "team-a=3001"), "--network": ("network", "none")}
REPEATED = ("tenant_paths", "tenant_groups")  # given once per tenant: joined with ';'



def isolation_options(args: list[str], prog: str) -> dict[str, str]:
    """Take the isolation flags from `args`, check them, and set them for this process and its worker (a nanny's
    worker is a process of its own: it reads them from the environment as dask config)."""
    import dask

    from dask_gpu.isolation import CONFIG_KEY, IsolationError, plan_for, settings_from_config

    given: dict[str, str] = {}
    for flag, (field, example) in ISOLATION_FLAGS.items():
        values = take_option(args, flag, prog, example, many=field in REPEATED)
        if values:
            given[field] = ";".join(values) if field in REPEATED else values[0]
    for field, value in given.items():
        os.environ[f"DASK_DASK_GPU__ISOLATION__{field.upper()}"] = value
    dask.config.set({f"{CONFIG_KEY}.{field.replace('_', '-')}": value for field, value in given.items()})
    try:
        plan = plan_for(settings_from_config())
    except IsolationError as exc:
        sys.exit(f"{prog}: {exc}")
    print(f"{prog}: isolation: {plan.describe()}", file=sys.stderr, flush=True)
    return given


def listen_defaults(args: list[str]) -> list[str]:
    """`--host` and `--dashboard-address` for a worker given neither: the address of this host that reaches the
    scheduler (so a one-machine cluster listens on 127.0.0.1 only), instead of Dask's every interface.

    That address is the one Dask advertises anyway (its route to the scheduler), so nothing else changes. The
    arguments are parsed by `dask worker`'s own parser, so every option keeps its meaning.
    """
    from click.core import ParameterSource
    from distributed.cli.dask_worker import main as dask_worker

    ctx = dask_worker.make_context("dask-gpu-worker", list(args), resilient_parsing=True)
    given = {name for name in ("host", "listen_address", "interface", "dashboard_address")
             if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE}
    host = ctx.params.get("host")
    if not given & {"host", "listen_address", "interface"} and ctx.params.get("scheduler"):
        from distributed.comm import get_address_host
        from distributed.utils import get_ip

        host = get_ip(get_address_host(ctx.params["scheduler"]))
        args = [*args, "--host", host]
    if host and "dashboard_address" not in given:  # Dask's ':0' is every interface, with or without a dashboard
        args = [*args, "--dashboard-address", f"{host}:0"]
    return args


WORKER_OPTIONS = """\
dask-gpu-worker's own options (before Dask's, which follow):
  --declared SPEC                 the GPUs to advertise where NVML finds none, e.g. '2 GPUs, 80 GB, H100'
  --trust-key KEY                 a control plane's public key (`aisched serve --print-key`); repeatable
  --tls-dir DIR                   ca.pem, cluster.pem, cluster.key (what `dask-gpu-scheduler --tls-dir` writes)
  --isolation MODE                auto (default: isolated as root with bubblewrap) | isolated | unisolated | shared
  --tenant NAME                   serve this tenant's bodies only (required where the worker does not isolate)
  --body-uids FIRST-LAST          the UIDs isolated bodies run under (default 20000-20999)
  --device-nodes DIR              where this host's nvidia* device nodes are (default /dev)
  --network pasta|none|host       an isolated body's network: its own namespace with outbound through pasta
                                  (default), its own with loopback only, or the host's (one trusted team)
  --tenant-path TENANT=PATH[:ro]  a host path TENANT's bodies may reach; once per tenant
  --tenant-group TENANT=GID       the group TENANT's bodies run with (its shared storage's); once per tenant
Inside a Slurm job: only the job's GPUs (SLURM_JOB_GPUS), their GRES type and the job id are advertised, and
--isolation auto serves the one --tenant (Slurm's cgroup confines the job).
"""


def wants_help(args: list[str]) -> bool:
    return "--help" in args or "-h" in args


def main(argv: list[str] | None = None) -> None:
    prog = "dask-gpu-worker"
    args = list(sys.argv[1:] if argv is None else argv)
    if wants_help(args):  # the project's options first, then `dask worker`'s own
        print(WORKER_OPTIONS)
        from distributed.cli.dask_worker import main as dask_worker

        dask_worker.main(args=["--help"], prog_name=prog)
    declared = take_option(args, "--declared", prog, "'2 GPUs, 80 GB, H100'")
    if declared:
        try:
            discover(declared[0], source="--declared")  # a bad spec fails here, with its message, not inside the worker
        except InventorySpecError as exc:
            sys.exit(f"{prog}: {exc}")
        os.environ[DECLARED_ENV] = declared[0]
    elif os.environ.get(DECLARED_ENV) is not None:
        try:
            discover()
        except InventorySpecError as exc:
            sys.exit(f"{prog}: {exc}")
    keys = take_option(args, "--trust-key", prog, "KEY (the public key `aisched serve` prints)", many=True)
    if keys:
        spec = ",".join([*keys, *filter(None, [os.environ.get(TRUSTED_KEYS_ENV)])])
        try:
            parse_trusted_keys(spec)
        except TicketRejected as exc:
            sys.exit(f"{prog}: --trust-key: {exc}")
        os.environ[TRUSTED_KEYS_ENV] = spec
    isolation_options(args, prog)
    tls_dir = take_option(args, "--tls-dir", prog, "/etc/aisched/tls")
    if tls_dir:
        files = tls_files(tls_dir[0], "cluster", prog)
        args += ["--tls-ca-file", files["ca"], "--tls-cert", files["cert"], "--tls-key", files["key"]]
    args = listen_defaults(args)
    from distributed.cli.dask_worker import main as dask_worker

    dask_worker.main(args=[*args, "--preload", PRELOAD, "--preload-nanny", NANNY_PRELOAD], prog_name=prog)


if __name__ == "__main__":  # pragma: no cover
    main()
