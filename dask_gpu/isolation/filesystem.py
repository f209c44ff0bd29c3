"""What a body's process can see of the filesystem: a read-only allow-list, a private /tmp, home and /proc.

Why bubblewrap, and why not one bwrap per body. bwrap (Debian's `bubblewrap`,
what Flatpak runs every app in) builds the sandbox's root: an empty tmpfs into
which only the paths a body needs are bound read-only (the system's /usr, a
few /etc files, the Python install and the import path), plus /dev, /proc, a
/tmp, and this worker's GPU nodes; the worker's TLS files and local directory
are covered even where they lie under a bound path. That is the part where
hand-written code goes wrong (pivot_root, mount propagation, symlinked
system dirs), so it is left to bwrap. One bwrap per body would mean a Python
start and the body's imports in every body (bench/overhead.py: tens of
milliseconds bare, seconds with Prefect), so bwrap starts each tenant's zygote
once; each body forked from it then only adds what is its own (`enter_run`),
a few system calls measured in milliseconds:

- a PID namespace (its process is PID 1 there: /proc, mounted fresh, shows
  only the body and what it started, and killing it ends all of them),
- a mount namespace with a private tmpfs on /tmp and /dev/shm, its working directory
  (a directory of its own under the bodies directory, 0700, its UID's) bound
  on /home/body, the bodies directory itself covered, and a /dev of its own
  holding only its own GPU nodes (dask_gpu.isolation.devices).

All of it happens as root in the body's new process before it drops to its
own UID (dask_gpu.isolation.identity) and before it unpickles anything. The
zygote itself runs only the worker's own code; the modules a body names are
imported there only when they are installed packages (site-packages, the
standard library), otherwise in the body's own process after the drop, so a
flow's module-level code never runs with privileges.
"""

from __future__ import annotations

import ctypes
import os
import sysconfig
from collections.abc import Iterable

HOME = "/home/body"
BODIES = "/run/aisched-bodies"  # where the bodies directory is bound inside a tenant's sandbox
PATH = "/usr/local/bin:/usr/bin:/bin"
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# What the CUDA driver and NVML read about devices and topology (read-only; no cgroup or kernel knobs).
SYS_DIRS = ("/sys/block", "/sys/bus", "/sys/class", "/sys/dev", "/sys/devices")
ETC_FILES = ("resolv.conf", "hosts", "nsswitch.conf", "passwd", "group", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
             "ssl", "ca-certificates", "localtime", "alternatives", "os-release", "gai.conf", "host.conf", "protocols",
             "services", "mime.types")
# What the zygote keeps inside its sandbox (bwrap drops the rest of root's): forking bodies into namespaces of their
# own, making their directories, dropping them to their UIDs, cleaning up after them; CAP_NET_ADMIN brings up the
# loopback of each body's own network namespace (dask_gpu.isolation.network).
ZYGOTE_CAPS = ("CAP_SYS_ADMIN", "CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_FOWNER", "CAP_DAC_OVERRIDE", "CAP_KILL",
               "CAP_NET_ADMIN")

CLONE_NEWNS, CLONE_NEWPID = 0x00020000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
PRIVATE_DIRS = ("/tmp", "/dev/shm")  # each body gets its own, empty


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc().mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                         data.encode() if data else None), f"mount {target}")


def unshare(flags: int) -> None:
    _check(_libc().unshare(flags), "unshare")


def _outermost(paths: Iterable[str]) -> list[str]:
    """Existing paths, resolved, without those inside another one of them."""
    real = sorted({os.path.realpath(p) for p in paths if p and os.path.exists(p)}, key=len)
    out: list[str] = []
    for p in real:
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return sorted(out)


def without(paths: Iterable[str], excluded: Iterable[str]) -> list[str]:
    """`paths` less those equal to or inside any of `excluded` (the worker's scratch space Dask puts on sys.path).

    >>> without(["/opt/code", "/tmp/dask-scratch-space/worker-1", "/tmp/dask-scratch-space"], ["/tmp/dask-scratch-space"])
    ['/opt/code']
    """
    out = [os.path.realpath(e).rstrip("/") for e in excluded if e]
    return [p for p in paths if p and not any(os.path.realpath(p) == e or os.path.realpath(p).startswith(e + "/")
                                              for e in out)]


PACKAGES = ("dask_gpu", "aisched_prefect", "blocks", "flows")  # this project's: what a zygote and a body import


def package_dirs(names: Iterable[str] = PACKAGES) -> list[str]:
    """Where these packages' files are: beside site-packages for an editable install (`pip install -e .`), whose
    import hook maps a name to the checkout without a sys.path entry. Only the package folders, never the
    checkout around them (it may hold a control plane's home and keys)."""
    import importlib.util

    out: list[str] = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.submodule_search_locations:
            out.extend(str(p) for p in spec.submodule_search_locations)
    return out


def code_paths(sys_path: Iterable[str], extra: Iterable[str] = ()) -> list[str]:
    """What a body must read: the interpreter and its install, the import path, this project's packages, and the
    operator's extra paths."""
    import sys

    install = [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable)),
               os.path.dirname(sys.executable), *sysconfig.get_paths().values()]
    return _outermost([*install, *sys_path, *package_dirs(), *extra])


def _ancestors(path: str) -> list[str]:
    """'/a/b/c' -> ['/a', '/a/b'] (not '/', not the path itself)."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def sandbox_argv(bwrap: str, *, read_only: Iterable[str], hide: Iterable[str], devices: Iterable[tuple[str, str]],
                 bodies_dir: str) -> list[str]:
    """bwrap's arguments for a tenant's zygote (the command goes after them)."""
    args = [bwrap, "--die-with-parent", "--new-session", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    for cap in ZYGOTE_CAPS:
        args += ["--cap-add", cap]
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    for name in ETC_FILES:
        path = os.path.join("/etc", name)
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    for d in SYS_DIRS:
        if os.path.isdir(d):
            args += ["--ro-bind", d, d]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--dir", HOME, "--bind", bodies_dir, BODIES]
    system = [os.path.realpath(d) for d in SYSTEM_DIRS if os.path.isdir(d)]
    for path in read_only:
        if not any(path == s or path.startswith(s + "/") for s in system):
            args += ["--ro-bind", path, path]
    for src, dst in devices:
        args += ["--dev-bind", src, dst]
    # bwrap makes the parents of a bound path with the host's modes (/root: 0700): a body must traverse them.
    parents = sorted({a for p in read_only for a in _ancestors(p)} - set(read_only), key=len)
    for parent in parents:
        if not any(parent == s or parent.startswith(s + "/") for s in system):
            args += ["--chmod", "0755", parent]
    bound = [p for p in read_only]
    for path in sorted({os.path.realpath(p) for p in hide if p}):
        if not any(path == b or path.startswith(b.rstrip("/") + "/") for b in bound):
            continue  # not reachable in the sandbox at all
        if os.path.isdir(path):
            args += ["--tmpfs", path]
        elif os.path.exists(path):
            args += ["--ro-bind", "/dev/null", path]
    return args + ["--chdir", "/"]


def with_data(argv: list[str], paths: Iterable[str]) -> list[str]:
    """A tenant's sandbox: `argv` (sandbox_argv's) with its data paths bound at the same place (`PATH:ro` read-only;
    a path that does not exist on this host is skipped: its body then fails naming it)."""
    binds: list[str] = []
    bound = []
    for p in paths:
        path, ro = (p[:-3], True) if p.endswith(":ro") else (p, False)
        if os.path.exists(path):
            binds += ["--ro-bind" if ro else "--bind", path, path]
            bound.append(path)
    system = [os.path.realpath(d) for d in SYSTEM_DIRS if os.path.isdir(d)]
    for parent in sorted({a for p in bound for a in _ancestors(p)} - set(bound), key=len):  # made by bwrap: traversable
        if not any(parent == s or parent.startswith(s + "/") for s in system):
            binds += ["--chmod", "0755", parent]
    cut = len(argv) - 2 if argv[-2:] and argv[-2] == "--chdir" else len(argv)
    return [*argv[:cut], *binds, *argv[cut:]]


def unescape_mountinfo(field: str) -> str:
    r"""A path as /proc/self/mountinfo writes it, decoded (space, tab, newline and backslash are octal escapes).

    >>> unescape_mountinfo(r"/tmp/a\040b")
    '/tmp/a b'
    """
    import re

    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts_under(roots: Iterable[str], mountinfo: str) -> list[tuple[str, bool]]:
    """The outermost mount points strictly inside any of `roots`, in the order they were mounted, each with whether
    it is mounted read-only (a tenant's data path under /tmp stays writable when the body's tmpfs covers /tmp).

    >>> info = "1 0 0:1 / / rw - tmpfs x rw\\n2 1 0:2 / /tmp rw - tmpfs x rw\\n3 2 8:1 /v /tmp/c/.venv ro - ext4 /dev/vda rw\\n"
    >>> info += "4 3 0:3 / /tmp/c/.venv/k rw - tmpfs x rw\\n5 2 8:1 /d /tmp/data rw,nosuid - ext4 /dev/vda rw\\n"
    >>> mounts_under(["/tmp", "/dev/shm"], info)
    [('/tmp/c/.venv', True), ('/tmp/data', False)]
    """
    roots = [r.rstrip("/") for r in roots]
    points: dict[str, bool] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 5:
            points[unescape_mountinfo(fields[4])] = "ro" in fields[5].split(",")
    inside = [p for p in points if any(p.startswith(r + "/") for r in roots)]
    return [(p, points[p]) for p in inside if not any(q != p and p.startswith(q + "/") for q in inside)]


def _private_dirs(uid: int, gid: int, size: int | None = None) -> None:
    """A fresh tmpfs on each of PRIVATE_DIRS, with the sandbox's binds under them kept as they were (a checkout in /tmp
    read-only, a tenant's data path writable unless given `:ro`).

    The binds are held open by O_PATH descriptors while the tmpfs covers them, then bound back (with what is mounted
    inside them: the covers over the worker's local directory and TLS files) and made read-only again."""
    with open("/proc/self/mountinfo") as f:
        keep = mounts_under(PRIVATE_DIRS, f.read())
    held = [(path, read_only, os.open(path, os.O_PATH | os.O_CLOEXEC)) for path, read_only in keep]
    for d in PRIVATE_DIRS:  # NCCL and DataLoader use /dev/shm
        sized = f",size={size}" if size else ""
        mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,uid={uid},gid={gid}{sized}")
    for path, read_only, fd in held:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(path, mode=0o755, exist_ok=True)
        else:
            open(path, "a").close()
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        mount("none", path, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | (MS_RDONLY if read_only else 0))
        os.close(fd)


def enter_run(uid: int, gid: int, workdir: str, devices: Iterable[int], tmp_bytes: int | None = None) -> None:
    """In a body's new process (root, PID 1 of its own PID namespace): its own mount namespace and views.

    A /dev of its own (the standard nodes and only its own GPU nodes, on a fresh tmpfs: nothing is removed from the /dev
    the tenant's bodies share), a private /tmp and /dev/shm, its working directory on /home/body, the other bodies'
    directories covered, and a /proc of its PID namespace. /tmp and /dev/shm each hold at most `tmp_bytes` (half the
    body's memory bound: a full one says ENOSPC, not the kernel's default of half the host's memory). The caller then
    drops to `uid`."""
    from dask_gpu.isolation.devices import private_dev

    unshare(CLONE_NEWNS)
    mount("none", "/", None, MS_REC | MS_PRIVATE)
    private_dev(devices)  # first: it covers /dev, and _private_dirs then mounts the body's tmpfs on its /dev/shm
    _private_dirs(uid, gid, tmp_bytes)
    mount(workdir, HOME, None, MS_BIND)
    mount("tmpfs", BODIES, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0000,size=4k")
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def body_env(extra: dict[str, str], import_path: Iterable[str]) -> dict[str, str]:
    """A body's whole environment: nothing of the worker's, only what its run gives it and where it lives."""
    seen = list(dict.fromkeys(p for p in import_path if p and os.path.exists(p)))
    return {"PATH": PATH, "HOME": HOME, "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PWD": HOME,
            "PYTHONPATH": ":".join(seen), **extra}
