"""Which cgroup a body gets on this worker: whether the worker can make them, and each body's bounds.

The mechanism is dask_gpu.isolation.cgroups (Slurm's task/cgroup); this is the worker's policy over it: a memory
bound of the body's GPU share of the host's memory unless the operator set one (Slurm's `DefMemPerGPU`), the
operator's PID bound, a CPU weight of an ordinary process (more for several GPUs), and, on an isolated worker, a device rule for exactly its own GPU
nodes and the standard ones.
"""

from __future__ import annotations

import os
from typing import Any

from dask_gpu.inventory import WorkerInventory
from dask_gpu.isolation import IsolationPlan


def cgroups_unavailable(plan: IsolationPlan | None) -> str | None:
    """Why bodies get no cgroup on this worker (None: they do): the operator turned them off, the worker is not root,
    or the host's cgroups cannot be written."""
    from dask_gpu.isolation.cgroups import cgroups_available

    if plan is None or not plan.settings.cgroups:
        return "turned off (dask-gpu.isolation.cgroups: false)"
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the worker does not run as root"
    why = cgroups_available()
    if why is None:
        _widen_parent()
        sweep_stale()
    return why


STALE_SECONDS = 60.0


def sweep_stale(older_than: float = STALE_SECONDS, root: str | None = None) -> int:
    """Remove body cgroups a dead worker left behind (a worker killed with its bodies never removed theirs): empty,
    and made more than `older_than` seconds ago (a live worker fills a body's cgroup within milliseconds of making
    it). How many were removed."""
    import time

    from dask_gpu.isolation import cgroups

    found = cgroups.layout()
    if found is None:
        return 0
    removed, now = 0, time.time()
    for controller_dir in found.dirs.values():
        parent = os.path.join(controller_dir, root or cgroups.ROOT)
        try:
            names = [n for n in os.listdir(parent) if n.startswith("body-")]
        except OSError:
            continue
        for name in names:
            path = os.path.join(parent, name)
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    if f.read().strip() or now - os.stat(path).st_mtime < older_than:
                        continue
                os.rmdir(path)
                removed += 1
            except OSError:  # in use again, or gone meanwhile
                continue
    return removed


def _widen_parent() -> None:
    """The bodies' parent group competes for CPU as one entity: give it the weight of four ordinary processes per
    core (without cgroups each body weighed as one process, and a GPU host's bodies are its work), so that bodies
    together are not starved by whatever else runs on the host, nor starve its daemons (cgroup v1 cpu.shares, v2
    cpu.weight)."""
    from dask_gpu.isolation import cgroups

    found = cgroups.layout()
    cores = os.cpu_count() or 1
    try:
        if found is not None and found.version == 1 and "cpu" in found.dirs:
            parent = os.path.join(found.dirs["cpu"], cgroups.ROOT)
            os.makedirs(parent, exist_ok=True)
            with open(os.path.join(parent, "cpu.shares"), "w") as f:
                f.write(str(min(4 * 1024 * cores, 262144)))
        elif found is not None and found.version == 2:
            parent = os.path.join(found.dirs[""], cgroups.ROOT)
            if os.path.exists(os.path.join(parent, "cpu.weight")):
                with open(os.path.join(parent, "cpu.weight"), "w") as f:
                    f.write(str(min(4 * 100 * cores, 10000)))
    except OSError:  # the default weight: bodies still run, just with less CPU under contention
        pass


def body_memory_bytes(gpus: float, plan: IsolationPlan, inventory: WorkerInventory) -> int:
    """A body's memory bound: the operator's `body-memory-gb`, else its GPU share of the host's memory (at least 1 GiB).
    Its cgroup's limit; its private /tmp and /dev/shm hold half of it each (their pages count against that limit, so
    a full /tmp says ENOSPC while the process still has room, as Kubernetes sizes a memory-backed emptyDir)."""
    import psutil

    if plan.settings.body_memory_gb:
        return int(plan.settings.body_memory_gb * 2**30)
    share = min(max(gpus, 0.05) / max(len(inventory.devices), 1), 1.0)
    return int(max(psutil.virtual_memory().total * share, 2**30))


def body_cgroup(body: Any, gpus: float, plan: IsolationPlan, inventory: WorkerInventory) -> Any:
    """A fresh cgroup for `body` (a dask_gpu.worker.bodies.BodyProcess holding its devices), bounded for a run of `gpus`."""
    from dask_gpu.isolation import cgroups, devices

    settings = plan.settings
    memory = body_memory_bytes(gpus, plan, inventory)
    nodes = [src for src, _ in devices.sandbox_nodes(settings.device_nodes, [d.index for d in body.devices])]
    return cgroups.BodyCgroup(f"body-{body.id}", cgroups.Limits(
        memory_bytes=int(memory), pids=settings.body_pids, cpu_shares=int(1024 * max(gpus, 1.0))),
        devices=nodes if plan.mode == "isolated" else None)
