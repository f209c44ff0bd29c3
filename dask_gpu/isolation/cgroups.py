"""A cgroup per body: its memory, PID and CPU bounds, the devices it may open, and every process it started.

Slurm's `task/cgroup` (ConstrainRAMSpace, ConstrainDevices, ConstrainCores as
a share) and `proctrack/cgroup` in one class. Why a cgroup and not the
process group or the PID namespace: a body's memory or fork bomb must stop at
the body, not take the host's other tenants with it; and a double-forked
daemon (setsid + fork) leaves the body's process group but never its cgroup,
so `kill_all` finds and ends it, and nothing of a run outlives it. The device
rule (cgroup v1's `devices` controller) is the second wall behind the body's
own /dev (dask_gpu.isolation.devices.private_dev): a node made or found
another way (mknod, a bind the body should not have had) cannot be opened.

Layouts, as Slurm supports both: cgroup v1 (one hierarchy per controller,
/sys/fs/cgroup/<controller>/<root>/<name>) and cgroup v2 (one hierarchy,
/sys/fs/cgroup/<root>/<name> with memory.max, pids.max, cpu.weight). On v2 the
device controller is a BPF program only, not a file: there the device rule
is skipped with a logged note and the body's own /dev is the bound. The worker
owns `<root>` (default `dask-gpu`); tests use a root of their own.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass

from dask_gpu.isolation._errors import lazy_errors

__getattr__ = lazy_errors(__name__, {
    "CgroupError": "A body's cgroup could not be made, limited, emptied or removed."})

log = logging.getLogger(__name__)

MOUNT = "/sys/fs/cgroup"
ROOT = "dask-gpu"
V1_REQUIRED = ("memory", "pids", "devices", "cpu")
V1_CONTROLLERS = (*V1_REQUIRED, "freezer")  # the freezer, where mounted, stops forks while kill_all signals
V2_REQUIRED = ("memory", "pids", "cpu")
# The standard character devices a body's /dev holds (null, zero, full, random, urandom, tty, console, ptmx, pts/*).
STANDARD_DEVICES = ("c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 1:8 rwm", "c 1:9 rwm", "c 5:0 rwm", "c 5:1 rwm",
                    "c 5:2 rwm", "c 136:* rwm")
OOM_REASON = "body-out-of-memory"  # the reason a settlement names for a body its cgroup's OOM killer ended


@dataclass(frozen=True)
class Layout:
    """Where this host's cgroups are: v1, a mount point per controller; v2, one mount point (under "")."""

    version: int
    dirs: dict[str, str]


def _mountinfo() -> str:
    with open("/proc/self/mountinfo") as f:
        return f.read()


def layout(mount: str = MOUNT, mountinfo: str | None = None) -> Layout | None:
    """The cgroup layout at `mount`: v2 if `mount` is a cgroup2 filesystem, v1 if controllers are mounted under it.

    >>> info = "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\\n"
    >>> layout("/sys/fs/cgroup", info + "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\\n")
    Layout(version=1, dirs={'memory': '/sys/fs/cgroup/memory', 'cpu': '/sys/fs/cgroup/cpu,cpuacct'})
    >>> layout("/sys/fs/cgroup", "26 21 0:22 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\\n")
    Layout(version=2, dirs={'': '/sys/fs/cgroup'})
    """
    from dask_gpu.isolation.filesystem import unescape_mountinfo

    mount = mount.rstrip("/") or "/"
    dirs: dict[str, str] = {}
    v2 = False
    for line in (mountinfo if mountinfo is not None else _mountinfo()).splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = unescape_mountinfo(fields[4])
        fstype, _source, options = (line.split(" - ", 1)[1].split() + ["", ""])[:3]
        if fstype == "cgroup2" and point == mount:
            v2 = True
        elif fstype == "cgroup" and (point == mount or point.startswith(mount + "/")):
            for option in options.split(","):
                if option in V1_CONTROLLERS:
                    dirs.setdefault(option, point)
    if v2:
        return Layout(2, {"": mount})
    return Layout(1, dirs) if dirs else None


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def cgroups_available(mount: str = MOUNT, root: str = ROOT) -> str | None:
    """Why this worker cannot give bodies cgroups (None: it can). A worker that cannot logs this and goes on."""
    if os.geteuid() != 0:
        return "the worker does not run as root, so it cannot make cgroups for its bodies"
    try:
        found = layout(mount)
    except OSError as exc:
        return f"/proc/self/mountinfo cannot be read ({exc})"
    if found is None:
        return f"no cgroup filesystem is mounted at {mount}"
    if found.version == 1:
        missing = [c for c in V1_REQUIRED if c not in found.dirs]
        if missing:
            return f"cgroup v1 controllers {', '.join(missing)} are not mounted under {mount}"
        unwritable = [d for d in found.dirs.values() if not os.access(d, os.W_OK)]
        return f"cgroup v1 at {', '.join(unwritable)} is read-only here" if unwritable else None
    try:
        have = _read(os.path.join(mount, "cgroup.controllers")).split()
    except OSError as exc:
        return f"cgroup v2 at {mount} cannot be read ({exc})"
    missing = [c for c in V2_REQUIRED if c not in have]
    if missing:
        return f"cgroup v2 at {mount} offers no {', '.join(missing)} controller (they may be bound to a v1 hierarchy)"
    return None if os.access(mount, os.W_OK) else f"cgroup v2 at {mount} is read-only here"


def device_rules(paths: Iterable[str]) -> list[str]:
    """cgroup v1 `devices.allow` lines for the standard nodes and each node in `paths` (its major:minor, read from the
    node; a directory such as /dev/nvidia-caps: each node in it). A path that does not exist is skipped."""
    rules = list(STANDARD_DEVICES)
    for path in paths:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        nodes = [st]
        if stat.S_ISDIR(st.st_mode):
            nodes = []
            for entry in os.scandir(path):
                try:
                    nodes.append(entry.stat())
                except FileNotFoundError:
                    continue
        for node in nodes:
            kind = "c" if stat.S_ISCHR(node.st_mode) else "b" if stat.S_ISBLK(node.st_mode) else None
            if kind:
                rule = f"{kind} {os.major(node.st_rdev)}:{os.minor(node.st_rdev)} rwm"
                if rule not in rules:
                    rules.append(rule)
    return rules


@dataclass(frozen=True)
class Limits:
    """A body's bounds; None leaves one unset. `cpu_shares` in v1's units (1024: one ordinary process's share)."""

    memory_bytes: int | None = None
    pids: int | None = None
    cpu_shares: int | None = None

    def cpu_weight(self) -> int | None:
        """`cpu_shares` as cgroup v2's cpu.weight (1-10000, 100 the default), as systemd converts it."""
        if self.cpu_shares is None:
            return None
        return max(1, min(10000, 1 + ((max(2, self.cpu_shares) - 2) * 9999) // 262142))


def _check_name(what: str, value: str) -> None:
    parts = value.split("/")
    if not value or value.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise __getattr__("CgroupError")(f"{what} {value!r} is not a relative cgroup path. Fix: give a plain name "
                                         "such as dask-gpu (root) or body-<run> (a body)")


class BodyCgroup:
    """One body's cgroup under `<mount>/[<controller>/]<root>/<name>`, made (and limited) when this is built.

    `devices`: the nodes the body may open besides the standard ones (its GPU nodes and the control nodes); None
    sets no device rule. Put the body in with `add(pid)` (or `enter()` from its own process) before it runs anything
    a flow sent; end it with `kill_all()`, then `remove()`."""

    def __init__(self, name: str, limits: Limits = Limits(), devices: Iterable[str] | None = None, *,
                 root: str = ROOT, mount: str = MOUNT) -> None:
        _check_name("root", root)
        _check_name("name", name)
        if "/" in name:
            raise __getattr__("CgroupError")(f"name {name!r} holds a '/'. Fix: one path component per body")
        found = layout(mount)
        if found is None:
            raise __getattr__("CgroupError")(f"no cgroup filesystem is mounted at {mount}. Fix: mount cgroup v2 on "
                                             f"{mount}, or v1 controllers under it (systemd does either)")
        self.name, self.limits, self.version, self.mount = name, limits, found.version, mount
        if found.version == 1:
            missing = [c for c in V1_REQUIRED if c not in found.dirs]
            if missing:
                raise __getattr__("CgroupError")(f"cgroup v1 controllers {', '.join(missing)} are not mounted under "
                                                 f"{mount}. Fix: mount them, or run the worker without cgroups")
            self.dirs = {c: os.path.join(d, root, name) for c, d in found.dirs.items() if c in V1_CONTROLLERS}
        else:
            self._enable_v2(mount, root)
            self.dirs = {"": os.path.join(mount, root, name)}
        made: list[str] = []
        try:
            for d in self.dirs.values():
                if not os.path.isdir(d):
                    os.makedirs(d, mode=0o755)
                    made.append(d)
            self._limit(limits)
            self._restrict(devices)
        except BaseException as exc:
            for d in reversed(made):
                try:
                    os.rmdir(d)
                except OSError:
                    pass
            if not isinstance(exc, OSError):
                raise
            raise __getattr__("CgroupError")(f"cgroup {root}/{name} could not be set up: {exc}. Fix: run the worker "
                                             "as root on a host whose cgroup controllers it may write") from exc

    # -- set up ---------------------------------------------------------------------------------------------------

    @staticmethod
    def _enable_v2(mount: str, root: str) -> None:
        """Turn on memory, pids and cpu for the children of `mount` and of each level of `root` (v2 hands a
        controller down only where the parent's cgroup.subtree_control names it)."""
        level = mount
        for part in ["", *root.split("/")]:
            level = os.path.join(level, part) if part else level
            os.makedirs(level, mode=0o755, exist_ok=True)
            try:
                have = _read(os.path.join(level, "cgroup.controllers")).split()
                on = _read(os.path.join(level, "cgroup.subtree_control")).split()
            except OSError:
                continue
            for controller in V2_REQUIRED:
                if controller in have and controller not in on:
                    try:
                        _write(os.path.join(level, "cgroup.subtree_control"), f"+{controller}")
                    except OSError as exc:
                        log.info("cgroup v2: cannot enable %s in %s: %s", controller, level, exc)

    def _file(self, controller: str, v1: str, v2: str) -> str | None:
        d = self.dirs.get(controller if self.version == 1 else "")
        if d is None:
            return None
        path = os.path.join(d, v1 if self.version == 1 else v2)
        return path if os.path.exists(path) else None

    def _set(self, controller: str, v1: str, v2: str, value: str) -> None:
        path = self._file(controller, v1, v2)
        if path is None:
            raise __getattr__("CgroupError")(
                f"cgroup {self.name}: no {v1 if self.version == 1 else v2} (the {controller} controller is not "
                f"available here). Fix: enable the {controller} controller, or leave that limit unset")
        _write(path, value)

    def _limit(self, limits: Limits) -> None:
        if limits.memory_bytes is not None:
            size = str(int(limits.memory_bytes))
            self._set("memory", "memory.limit_in_bytes", "memory.max", size)
            swap = self._file("memory", "memory.memsw.limit_in_bytes", "memory.swap.max")
            if swap is not None:  # swap is no way past the limit
                _write(swap, size if self.version == 1 else "0")
        if limits.pids is not None:
            self._set("pids", "pids.max", "pids.max", str(int(limits.pids)))
        if limits.cpu_shares is not None:
            value = limits.cpu_shares if self.version == 1 else limits.cpu_weight()
            self._set("cpu", "cpu.shares", "cpu.weight", str(value))

    def _restrict(self, devices: Iterable[str] | None) -> None:
        if devices is None:
            return
        if self.version == 2:
            log.info("cgroup v2 has no device file (its device controller is a BPF program): body %s's device rule is "
                     "skipped; its own /dev (dask_gpu.isolation.devices.private_dev) is the bound", self.name)
            return
        d = self.dirs["devices"]
        _write(os.path.join(d, "devices.deny"), "a")
        for rule in device_rules(devices):
            _write(os.path.join(d, "devices.allow"), rule)

    # -- processes ------------------------------------------------------------------------------------------------

    def add(self, pid: int) -> None:
        """Move process `pid` (all its threads) into this cgroup, in every controller."""
        for d in self.dirs.values():
            _write(os.path.join(d, "cgroup.procs"), str(int(pid)))

    def enter(self) -> None:
        """Move the calling process in (from the body's own process, before it runs anything a flow sent)."""
        self.add(os.getpid())

    def pids(self) -> set[int]:
        """Every process in this cgroup (in any of its controllers), daemons that left the body's session included."""
        out: set[int] = set()
        for d in self.dirs.values():
            try:
                out.update(int(p) for p in _read(os.path.join(d, "cgroup.procs")).split())
            except FileNotFoundError:
                continue
        return out

    def _freeze(self, frozen: bool) -> None:
        """Stop (or let go) every process in the cgroup, so none forks while they are signalled; waits a little for
        FROZEN, and goes on without it (SIGKILL still ends them once thawed)."""
        if self.version == 1:
            path = os.path.join(self.dirs.get("freezer", "/nonexistent"), "freezer.state")
            want, value = ("FROZEN", "FROZEN") if frozen else ("THAWED", "THAWED")
        else:
            path = os.path.join(self.dirs[""], "cgroup.freeze")
            want, value = ("frozen 1", "1") if frozen else ("frozen 0", "0")
        if not os.path.exists(path):
            return
        _write(path, value)
        check = path if self.version == 1 else os.path.join(self.dirs[""], "cgroup.events")
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            state = _read(check)
            if (want == state.strip()) if self.version == 1 else (want in state.splitlines()):
                return
            time.sleep(0.002)

    def kill_all(self, timeout: float = 10.0) -> int:
        """SIGKILL every process in the cgroup, again until it is empty; returns how many were signalled.

        Frozen first where a freezer is (v1's freezer controller, v2's cgroup.freeze), so nothing forks between the
        listing and the signal; v2's cgroup.kill does all of it at once where the kernel has it. Raises CgroupError if
        processes are still there after `timeout` seconds."""
        signalled: set[int] = set()
        kill_file = os.path.join(self.dirs.get("", ""), "cgroup.kill") if self.version == 2 else None
        deadline = time.monotonic() + timeout
        while True:
            if kill_file and os.path.exists(kill_file):
                signalled |= self.pids()
                _write(kill_file, "1")
            else:
                self._freeze(True)
                try:
                    found = self.pids()
                    for pid in found - signalled:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    signalled |= found
                finally:
                    self._freeze(False)
            settle = min(deadline, time.monotonic() + 0.5)
            while self.pids() and time.monotonic() < settle:
                time.sleep(0.005)
            left = self.pids()
            if not left:
                return len(signalled)
            if time.monotonic() >= deadline:
                raise __getattr__("CgroupError")(
                    f"cgroup {self.name}: processes {sorted(left)[:10]} outlived SIGKILL for {timeout:.0f} s (stuck in "
                    "the kernel, e.g. on a hung device or NFS). Fix: look at their /proc/PID/stack; the cgroup is "
                    "left in place")
            signalled -= left  # signal them again (a pid listed before its process was killed may be a new one)

    # -- what the body used ---------------------------------------------------------------------------------------

    def peak_memory_bytes(self) -> int | None:
        """The most memory the cgroup held at once (v1 memory.max_usage_in_bytes, v2 memory.peak where present)."""
        path = self._file("memory", "memory.max_usage_in_bytes", "memory.peak")
        return int(_read(path)) if path else None

    def memory_events(self) -> dict[str, int]:
        """v1: memory.oom_control's counters (oom_kill, under_oom) and memory.failcnt; v2: memory.events."""
        out: dict[str, int] = {}
        path = self._file("memory", "memory.oom_control", "memory.events")
        if path:
            for line in _read(path).splitlines():
                key, _, value = line.partition(" ")
                if value.strip().isdigit():
                    out[key] = int(value)
        failcnt = self._file("memory", "memory.failcnt", "memory.failcnt")
        if failcnt and self.version == 1:
            out["failcnt"] = int(_read(failcnt))
        return out

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer ended a process of this cgroup for its memory limit (`body-out-of-memory`).

        Kernels before 4.13 (v1) count no kills: there a charge that failed at the limit is taken for one."""
        events = self.memory_events()
        if "oom_kill" in events:
            return events["oom_kill"] > 0
        return events.get("failcnt", 0) > 0

    # -- end ------------------------------------------------------------------------------------------------------

    def remove(self, timeout: float = 10.0) -> None:
        """Kill everything in the cgroup, then remove its directories (idempotent)."""
        if any(os.path.isdir(d) for d in self.dirs.values()):
            self.kill_all(timeout)
        for d in self.dirs.values():
            deadline = time.monotonic() + timeout
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:  # EBUSY: the last exits are still being accounted
                    if time.monotonic() >= deadline:
                        raise __getattr__("CgroupError")(f"cgroup {d} could not be removed: {exc}. Fix: see which "
                                                         "processes are in its cgroup.procs") from exc
                    time.sleep(0.01)

    def __enter__(self) -> BodyCgroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"BodyCgroup({self.name!r}, v{self.version}, {self.limits})"
