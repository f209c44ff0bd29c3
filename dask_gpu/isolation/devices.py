"""A body sees and can open only its own GPUs: `CUDA_VISIBLE_DEVICES`, and only its /dev/nvidia* nodes.

As Slurm's `ConstrainDevices` (there with a cgroup device rule, here too:
dask_gpu.isolation.cgroups): the tenant's sandbox binds this worker's GPU
nodes (`nvidiaN` for GPU N, from `device_nodes`, /dev unless configured) and
the shared control nodes (`nvidiactl`, `nvidia-uvm`, `nvidia-uvm-tools`,
`nvidia-modeset`) into its /dev, and each body's process builds, in its own
mount namespace, a /dev of its own (`private_dev`): a fresh tmpfs holding the
standard nodes and only its own GPU nodes, bound from the sandbox's.

Why a fresh /dev and never an unlink: the sandbox's /dev is one tmpfs that
the tenant's zygote and all its bodies share, and a mount namespace does not
copy a filesystem, only its mounts. A node unlinked there is gone for every
later body of that tenant, its own GPU's node included. Covering /dev with a
tmpfs of the body's own changes nothing anyone else sees.

A MIG instance is reached through its parent GPU's node plus
/dev/nvidia-caps, which stays bound: MIG instances of one GPU are told apart
by `CUDA_VISIBLE_DEVICES` only.
"""

from __future__ import annotations

import ctypes
import os
import stat
from collections.abc import Iterable

CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset", "nvidia-caps")


def gpu_node(index: int) -> str:
    return f"nvidia{index}"


def sandbox_nodes(source_dir: str, indices: Iterable[int]) -> list[tuple[str, str]]:
    """(host path, path in the sandbox) of every node this worker's bodies may be given; missing ones are skipped."""
    out = []
    for name in [*(gpu_node(i) for i in sorted(set(indices))), *CONTROL_NODES]:
        src = os.path.join(source_dir, name)
        if os.path.exists(src):
            out.append((src, f"/dev/{name}"))
    return out


# What bwrap's `--dev` makes, each kept as it is there (a node or the devpts mount bound back, a symlink made again):
# the standard nodes, /dev/pts and /dev/ptmx, the /proc/self/fd links. /dev/shm comes back empty (each body's own).
STANDARD = ("null", "zero", "full", "random", "urandom", "tty", "console", "pts", "ptmx", "fd", "stdin", "stdout",
            "stderr", "core")
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC = 2, 4, 8, 4096, 16384


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                  data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def private_dev(own: Iterable[int], dev: str = "/dev") -> list[str]:
    """Give this process (in a mount namespace of its own, / already private) a /dev of its own; returns its names.

    Holds an O_PATH descriptor on each node it keeps (the standard ones, `own`'s `nvidiaN`, the control nodes that
    exist), mounts a fresh tmpfs on `dev` (nodev: a node made there later opens nothing), and binds each back through
    /proc/self/fd/N, as filesystem._private_dirs does. Nothing is unlinked from the /dev it covers, which other bodies
    share. Called anywhere but in a private mount namespace it would cover that namespace's /dev: don't."""
    held: list[tuple[str, int, bool]] = []  # name, O_PATH descriptor, is a directory
    links: dict[str, str] = {}
    try:
        for name in [*STANDARD, *(gpu_node(i) for i in sorted(set(own))), *CONTROL_NODES]:
            path = os.path.join(dev, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(st.st_mode):
                links[name] = os.readlink(path)
            else:
                held.append((name, os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC), stat.S_ISDIR(st.st_mode)))
        _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755,size=64k")
        os.mkdir(os.path.join(dev, "shm"))  # `filesystem._private_dirs` mounts the body's own tmpfs on it
        os.chmod(os.path.join(dev, "shm"), 0o1777)
        for name, fd, is_dir in held:
            path = os.path.join(dev, name)
            if is_dir:
                os.mkdir(path, 0o755)
            else:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        for name, target in links.items():
            os.symlink(target, os.path.join(dev, name))
    finally:
        for _, fd, _ in held:
            os.close(fd)
    return sorted(["shm", *(name for name, _, _ in held), *links])
