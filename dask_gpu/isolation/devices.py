"""A body sees and can open only its own GPUs: `CUDA_VISIBLE_DEVICES`, and only its /dev/nvidia* nodes.

As Slurm's `ConstrainDevices` (there with a cgroup device rule): the tenant's
sandbox binds this worker's GPU nodes (`nvidiaN` for GPU N, from
`device_nodes`, /dev unless configured) and the shared control nodes
(`nvidiactl`, `nvidia-uvm`, `nvidia-uvm-tools`, `nvidia-modeset`) into its
/dev, and each body's process removes, in its own mount namespace, every
`nvidiaN` node that is not one of its devices before it drops its privileges.
A MIG instance is reached through its parent GPU's node plus
/dev/nvidia-caps, which stays bound: MIG instances of one GPU are told apart
by `CUDA_VISIBLE_DEVICES` only.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable

CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset", "nvidia-caps")
MNT_DETACH = 2


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


def keep_only(own: Iterable[int], dev: str = "/dev") -> list[str]:
    """In a body's own mount namespace: remove every GPU node but `own`'s; returns the nodes removed."""
    libc = ctypes.CDLL(None, use_errno=True)
    keep = {gpu_node(i) for i in own}
    removed = []
    for name in sorted(os.listdir(dev)):
        if name.startswith("nvidia") and name[6:].isdigit() and name not in keep:
            path = os.path.join(dev, name)
            if libc.umount2(path.encode(), MNT_DETACH) != 0:
                raise OSError(ctypes.get_errno(), f"umount {path}")
            os.unlink(path)
            removed.append(path)
    return removed
