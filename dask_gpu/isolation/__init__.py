"""The tenant boundary on a GPU worker: what an admitted body can reach, chosen by configuration.

One module per concern, as Slurm's plugins are: `identity` (an unprivileged
UID/GID per body, from a range the operator gives), `filesystem` (the sandbox a
tenant's zygote runs in, built by bubblewrap, and each body's private /tmp,
working directory and /proc), `devices` (only the body's own /dev/nvidia*
nodes). `plan_for` decides, once at the worker's start, in which mode it runs:

- `isolated`: the worker runs as root and bubblewrap is there (how a GPU host's worker runs). Each tenant
  gets a zygote of its own inside a bwrap sandbox; each body gets its own UID, PID and mount namespaces.
- `unisolated`: it cannot isolate (not root, or no bwrap): bodies run as the worker's user, and the worker
  serves one tenant only, the one it was started for (`--tenant NAME`, required: a worker without it refuses
  to start, since a tenant learned from the first body would be forgotten when its nanny restarts it).
- inside a Slurm job (SLURM_JOB_ID set), `auto` means `unisolated`: the worker runs as the job's user, Slurm's
  own cgroup confines the job (its CPUs, memory and GPUs), and one worker job serves one tenant (`--tenant NAME`,
  required), refusing every other tenant's run. `--isolation isolated` still isolates where it can (root, bwrap).
- `shared`: the operator said so (`--isolation shared`): bodies of every tenant run as the worker's user,
  as in plain Dask. For one trusted team, or a test cluster; it is logged and advertised as such.

Settings come from dask.config (`dask-gpu.isolation.*`, so `DASK_DASK_GPU__ISOLATION__MODE=...` in the
environment) and `dask-gpu-worker`'s flags (`--isolation`, `--tenant`, `--body-uids`, `--device-nodes`, `--network`).
`network` (dask_gpu.isolation.network): each isolated body's own network namespace, outbound through pasta (default),
none, or the host's.
"""

from __future__ import annotations

import functools
import os
import shutil
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dask_gpu.errors import DaskGPUError

CONFIG_KEY = "dask-gpu.isolation"
MODES = ("auto", "isolated", "unisolated", "shared")


class IsolationError(DaskGPUError):
    """A worker cannot run a body under the isolation it was configured for (or a setting is malformed)."""


class TenantRefused(IsolationError):
    """A worker that does not isolate bodies refused a body of a second tenant."""


class IsolationSettings(BaseModel):
    """What the operator asked for (dask.config `dask-gpu.isolation`, or `dask-gpu-worker` flags)."""

    model_config = ConfigDict(frozen=True)

    mode: Literal["auto", "isolated", "unisolated", "shared"] = "auto"
    tenant: str | None = None  # the one tenant an unisolated worker serves
    body_uids: tuple[int, int] = (20000, 20999)  # first, last (inclusive)
    bwrap: str = "/usr/bin/bwrap"
    device_nodes: str = "/dev"  # where this host's nvidia* nodes are (a test points it at stand-ins)
    bodies_dir: str | None = None  # each body's working directory lives under it (default: the worker's local dir)
    uid_locks: str = "/run/dask-gpu/uids"  # this host's workers lease body UIDs here, one at a time each (flock)
    extra_paths: tuple[str, ...] = Field(default=())  # more read-only paths a body may read (datasets, models)
    tenant_paths: dict[str, tuple[str, ...]] = Field(default_factory=dict)  # tenant -> host paths its bodies may
    # reach (read-write; PATH:ro read-only), bound at the same path into its sandbox: a team's shared storage
    tenant_groups: dict[str, int] = Field(default_factory=dict)  # tenant -> the group (GID) its bodies run with
    cgroups: bool = True  # a cgroup per body (memory, PIDs, CPU share, devices) where the worker may make them
    body_memory_gb: float | None = Field(default=None, gt=0)  # each body's memory bound (None: its GPU share of
    # the host's memory, as Slurm's DefMemPerGPU)
    body_pids: int = Field(default=4096, ge=16)  # most processes and threads one body may have at once
    network: Literal["pasta", "none", "host"] = "pasta"  # each body's own network namespace, with outbound through
    # pasta, none (loopback only), or the host's namespace (dask_gpu.isolation.network)
    pasta: str = "/usr/bin/pasta"
    netns_dir: str = "/run/dask-gpu/netns"  # where this host's workers hold their bodies' namespaces for pasta

    @field_validator("body_uids", mode="before")
    @classmethod
    def _uids(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                first, last = (int(v) for v in value.split("-", 1))
            except ValueError:
                raise ValueError(f"body_uids {value!r} is not a range FIRST-LAST. Fix: --body-uids 20000-20999") from None
            value = (first, last)
        first, last = value
        if not 1000 <= first <= last < 2**31:
            raise ValueError(f"body_uids {first}-{last}: give an unprivileged range (1000 or more, FIRST <= LAST) that "
                             "no user of this host owns, e.g. 20000-20999")
        return (first, last)

    @field_validator("tenant_paths", mode="before")
    @classmethod
    def _tenant_paths(cls, value: Any) -> Any:
        """`TENANT=PATH[:ro][,PATH...];TENANT=...` (a flag or the environment), or a mapping."""
        if isinstance(value, str):
            value = _pairs(value, "tenant_paths", "team-a=/srv/data/team-a,/srv/models:ro")
        out: dict[str, tuple[str, ...]] = {}
        for tenant, paths in dict(value or {}).items():
            paths = tuple(p for p in (paths.split(",") if isinstance(paths, str) else paths) if p)
            for p in paths:
                path = p[:-3] if p.endswith(":ro") else p
                if not os.path.isabs(path) or os.path.normpath(path) in ("/", "/proc", "/dev", "/sys", "/run", "/etc"):
                    raise ValueError(f"tenant_paths: {tenant}={p} is not an absolute path of data a body may be given. "
                                     "Fix: --tenant-path TENANT=/srv/data/TENANT (add :ro for read-only)")
            out[str(tenant)] = paths
        return out

    @field_validator("tenant_groups", mode="before")
    @classmethod
    def _tenant_groups(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = _pairs(value, "tenant_groups", "team-a=3001")
        out = {}
        for tenant, gid in dict(value or {}).items():
            try:
                gid = int(gid)
            except (TypeError, ValueError):
                raise ValueError(f"tenant_groups: {tenant}={gid!r} is not a GID. Fix: --tenant-group TENANT=GID (the "
                                 "group that owns the team's shared storage)") from None
            if gid < 1000:
                raise ValueError(f"tenant_groups: {tenant}={gid} is a system group (below 1000): a body never runs "
                                 "with one. Fix: the GID of the team's own group")
            out[str(tenant)] = gid
        return out

    @field_validator("extra_paths", mode="before")
    @classmethod
    def _paths(cls, value: Any) -> Any:
        return tuple(p for p in value.split(":") if p) if isinstance(value, str) else tuple(value or ())


def _pairs(text: str, field: str, example: str) -> dict[str, str]:
    """`A=x;B=y` (or a single pair) as a mapping; a malformed part names the field and an example."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        tenant, sep, rest = part.partition("=")
        if not sep or not tenant.strip() or not rest.strip():
            raise ValueError(f"{field}: {part!r} is not TENANT=VALUE. Fix: e.g. {example}")
        out[tenant.strip()] = rest.strip()
    return out


def settings_from_config() -> IsolationSettings:
    """The settings in dask.config (`dask-gpu.isolation.*`); a malformed value names its key."""
    import dask

    raw = dask.config.get(CONFIG_KEY, default={}) or {}
    values = {str(k).replace("-", "_"): v for k, v in dict(raw).items() if v is not None}
    if "network" in dict(raw) and dict(raw)["network"] is None:  # dask reads the environment's `none` as None
        values["network"] = "none"
    strings = ("tenant", "bwrap", "device_nodes", "bodies_dir", "uid_locks", "network", "pasta", "netns_dir")
    for key in strings:  # the environment's "123" reads as a number
        if key in values:
            values[key] = str(values[key])
    try:
        return IsolationSettings(**values)
    except ValidationError as exc:
        what = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
                         for e in exc.errors())
        raise IsolationError(f"dask config {CONFIG_KEY} is malformed: {what}. Fix: see `dask-gpu-worker --help` "
                             "(--isolation, --tenant, --body-uids, --device-nodes, --network)") from None


def can_isolate(settings: IsolationSettings) -> str | None:
    """Why this process cannot isolate bodies (None: it can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the worker does not run as root, so it cannot give bodies identities of their own"
    bwrap = settings.bwrap if os.path.isfile(settings.bwrap) else shutil.which(settings.bwrap)
    if not bwrap or not os.access(bwrap, os.X_OK):
        return f"bubblewrap is not installed at {settings.bwrap} (Debian: apt-get install bubblewrap)"
    return _sandbox_works(bwrap)


@functools.lru_cache(maxsize=4)
def _sandbox_works(bwrap: str) -> str | None:
    """Whether bwrap can make namespaces here (a container without CAP_SYS_ADMIN, or a seccomp filter, may forbid
    them): one tiny sandbox at start, so `auto` never picks a mode every body would then fail in."""
    import subprocess

    try:
        out = subprocess.run([bwrap, "--unshare-pid", "--unshare-ipc", "--ro-bind", "/", "/", "--proc", "/proc",
                              "--dev", "/dev", "--tmpfs", "/tmp", "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap at {bwrap} could not start a sandbox ({exc})"
    if out.returncode != 0:
        return f"bubblewrap at {bwrap} cannot make a sandbox on this host: {out.stderr.strip()[-200:]}"
    return None


class IsolationPlan(BaseModel):
    """The mode a worker runs in, decided once at its start, and what it advertises."""

    model_config = ConfigDict(frozen=True)

    mode: Literal["isolated", "unisolated", "shared"]
    settings: IsolationSettings = IsolationSettings()
    why: str = ""  # why a worker asked for `auto` does not isolate

    def describe(self) -> str:
        """One line for the worker's log and `aisched workers`."""
        if self.mode == "isolated":
            first, last = self.settings.body_uids
            only = f", for tenant {self.settings.tenant} only" if self.settings.tenant else ""
            from dask_gpu.isolation.network import describe

            return (f"isolated: each body runs under its own UID ({first}-{last}), in its own PID and mount "
                    f"namespaces, with {describe(self.settings.network)}, one zygote per tenant{only}")
        if self.mode == "shared":
            return "shared: bodies of every tenant run as the worker's own user (the operator chose --isolation shared)"
        tenant = self.settings.tenant
        return (f"unisolated ({self.why}): bodies run as the worker's own user; it serves "
                + (f"tenant {tenant} only" if tenant else "no tenant (it was started without --tenant)"))


def plan_for(settings: IsolationSettings | None = None) -> IsolationPlan:
    """The mode this worker runs in. `isolated` that cannot be had is an error, not a silent downgrade."""
    settings = settings or settings_from_config()
    if settings.mode == "shared":
        return IsolationPlan(mode="shared", settings=settings)
    why = can_isolate(settings) if settings.mode in ("auto", "isolated") else "the operator chose --isolation unisolated"
    if settings.mode == "auto" and slurm_job_why():
        why = slurm_job_why()
    if why is None:
        from dask_gpu.isolation.network import unavailable

        lacking = unavailable(settings.network, settings.pasta)
        if lacking:  # never a silent fall back to the host's network: that is what bodies must not share
            raise IsolationError(f"dask-gpu.isolation.network {settings.network}: {lacking}. Fix: install it, or "
                                 "choose --network none (each body's own loopback, no outbound) or --network host "
                                 "(bodies share the host's network namespace: one trusted team)")
        return IsolationPlan(mode="isolated", settings=settings)
    if settings.mode == "isolated":
        raise IsolationError(f"--isolation isolated: {why}. Fix: run the worker as root with bubblewrap installed, "
                             "or start it for one tenant (--isolation unisolated --tenant NAME)")
    if not settings.tenant:  # its one tenant is fixed at start: one learned from a body dies with the process
        said = ("--isolation unisolated" if settings.mode == "unisolated"
                else f"this worker cannot isolate bodies ({why}), so it")
        raise IsolationError(f"{said} serves one tenant, fixed at start, and none was given. Fix: start it for that "
                             "tenant (--tenant NAME; dask config dask-gpu.isolation.tenant), run it as root with "
                             "bubblewrap installed (isolated), or --isolation shared for one trusted team")
    return IsolationPlan(mode="unisolated", settings=settings, why=why)


def slurm_job_why() -> str | None:
    """Why a worker inside a Slurm job serves one tenant rather than isolating bodies (None: not in a Slurm job)."""
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID")
    if not job:
        return None
    user = os.environ.get("SLURM_JOB_USER") or str(os.getuid())
    return (f"it runs in Slurm job {job} as {user}: Slurm's cgroup confines the job, and a worker job serves "
            "one tenant")


class TenantGate:
    """Which tenants' bodies a worker runs: any (isolated, shared, unless started for one), else only the one it was
    started for (unisolated; `plan_for` refuses an unisolated worker without one, and a plan made without one here
    admits nobody). Nothing is learned from the bodies it runs: what a restart would forget never decides."""

    def __init__(self, plan: IsolationPlan) -> None:
        self.plan = plan

    def admit(self, tenant: str, run: str) -> None:
        """Raise TenantRefused unless this worker may run a body of `tenant` (a ticket's tenant: signed)."""
        if self.plan.mode == "shared":
            return
        only = self.plan.settings.tenant
        if only is None and self.plan.mode == "unisolated":
            raise TenantRefused(f"run {run} of tenant {tenant or '(none named)'!r} is refused: this worker does not "
                                "isolate bodies and was started for no tenant. Fix: restart it for one tenant "
                                "(dask-gpu-worker --tenant NAME), or as root with bubblewrap (isolated)")
        if only is not None and tenant != only:
            raise TenantRefused(f"run {run} of tenant {tenant or '(none named)'!r} is refused: this worker serves "
                                f"tenant {only!r} only, because it was started for that tenant (--tenant). Fix: run "
                                "bodies of several tenants on a worker started as root with bubblewrap (isolated), or "
                                "give each tenant workers of its own (dask-gpu-worker --tenant NAME)")


__all__ = ["IsolationError", "IsolationPlan", "IsolationSettings", "TenantGate", "TenantRefused", "can_isolate",
           "plan_for", "settings_from_config"]
