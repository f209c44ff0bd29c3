"""A local Dask cluster of GPU-aware worker processes, and reading a cluster's inventory."""

from __future__ import annotations

import logging
import os
from typing import Any

from distributed import Client, Nanny, Scheduler, SpecCluster

from dask_gpu.inventory import DECLARED_ENV, WorkerInventory, parse_declared
from dask_gpu.live import DeviceState
from dask_gpu.plugin import PLUGIN_NAME, GPUWorkerPlugin

PRELOAD = "dask_gpu.preload"


class LocalGPUCluster(SpecCluster):
    """Worker processes on this host that advertise GPUs as Dask resources.

    With `declared` (or DASK_GPU_DECLARED) each declared worker becomes one
    process that advertises its declared devices; otherwise a single worker owns
    every device NVML finds (none, on a machine without GPUs). Either way the
    worker runs `dask_gpu.preload`, exactly as a remote `dask worker` would.
    `allowed_failures=0` (Dask's default is 3) makes a task whose worker dies
    fail with KilledWorker, so its retry goes through the caller's policy.
    """

    def __init__(
        self,
        declared: str | None = None,
        threads_per_worker: int | None = None,
        host: str = "127.0.0.1",
        silence_logs: int | bool = logging.WARNING,
        allowed_failures: int = 0,
        **kwargs: Any,
    ) -> None:
        spec = declared if declared is not None else os.environ.get(DECLARED_ENV)
        # Per worker: (DASK_GPU_DECLARED for that process or None for NVML, device count).
        plan: list[tuple[str | None, int]] = (
            [(g.spec(), g.gpus) for g in parse_declared(spec) for _ in range(g.workers)]
            if spec
            else [(None, 0)]
        )
        workers: dict[str, dict[str, Any]] = {}
        for i, (worker_spec, gpus) in enumerate(plan):
            env = {DECLARED_ENV: worker_spec} if worker_spec else {}
            workers[f"gpu-worker-{i}"] = {
                "cls": Nanny,
                "options": {
                    "nthreads": threads_per_worker or max(2, gpus + 1),
                    "host": host,
                    "preload": [PRELOAD],
                    "env": env,
                    "silence_logs": silence_logs,
                    "dashboard": False,
                },
            }
        scheduler = {
            "cls": Scheduler,
            # A task whose worker dies fails at once (KilledWorker) instead of being re-run
            # silently: the caller's retry policy decides, and each attempt is accounted.
            "options": {"host": host, "dashboard": False, "dashboard_address": ":0",
                        "allowed_failures": allowed_failures},
        }
        super().__init__(workers=workers, scheduler=scheduler, silence_logs=silence_logs, **kwargs)


def _worker_inventory(dask_worker: Any) -> tuple[str, dict[str, Any]]:
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    inv = plugin.inventory if isinstance(plugin, GPUWorkerPlugin) else WorkerInventory(source="none")
    return str(dask_worker.name), inv.model_dump(mode="json")


def cluster_inventories(client: Client) -> dict[str, WorkerInventory]:
    """Worker name -> inventory, for every worker connected now (one round trip).

    Keyed by name, not address: a worker that dies and is restarted by its
    nanny keeps its name, so a placement restricted to it stays valid.
    """
    raw = client.run(_worker_inventory)
    return {name: WorkerInventory.model_validate(inv) for name, inv in raw.values()}


def _worker_states(dask_worker: Any) -> tuple[str, dict[str, Any] | None]:
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    states = plugin.sample() if isinstance(plugin, GPUWorkerPlugin) else None
    return str(dask_worker.name), None if states is None else {k: v.model_dump() for k, v in states.items()}


def cluster_states(client: Client) -> dict[str, dict[str, DeviceState] | None]:
    """Worker name -> live state of each device (None where devices are declared), one round trip."""
    raw = client.run(_worker_states)
    return {name: None if states is None else {k: DeviceState(**v) for k, v in states.items()}
            for name, states in raw.values()}


def _stop_keys(keys: list[str], dask_worker: Any) -> None:
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    if isinstance(plugin, GPUWorkerPlugin):
        for key in keys:
            plugin.request_stop(key)


def _running_for(keys: list[str], dask_worker: Any) -> dict[str, float]:
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    return plugin.running_for(keys) if isinstance(plugin, GPUWorkerPlugin) else {}


def running_for(client: Client, keys: list[str]) -> dict[str, float]:
    """Seconds each task of `keys` has run since its worker gave it devices; absent: not started.

    One round trip to every worker, asked only about tasks whose start matters
    (say, one that may be nearing the runtime its budget covers), so running
    tasks cost the scheduler no messages of their own.
    """
    out: dict[str, float] = {}
    for found in client.run(_running_for, list(keys)).values():
        out.update(found)
    return out


def request_stop(client: Client, keys: list[str]) -> None:
    """Ask the tasks `keys` to stop, wherever they run or will run (one round trip to every worker).

    A subprocess started with `run_subprocess` is killed within a fraction of a
    second; Python code stops at its next `checkpoint()`; a task not started yet
    stops before it starts.
    """
    client.run(_stop_keys, list(keys))
