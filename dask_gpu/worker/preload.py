"""Dask preload that makes any worker GPU-aware: `dask worker ADDR --preload dask_gpu.worker.preload`.

It discovers this worker's GPUs (the inventory declared in DASK_GPU_DECLARED,
else NVML), advertises them as worker resources before the worker registers
with the scheduler, reads the control-plane keys it will trust
(DASK_GPU_TRUSTED_KEYS), and installs the device-assigning plugin, which
decides the worker's tenant boundary (dask_gpu.isolation: isolated when the
worker runs as root with bubblewrap) and logs it once. On TLS it installs the
default-deny gate (dask_gpu.gate); the nanny gets its own from
dask_gpu.worker.nanny_preload.
LocalGPUCluster starts its workers with this same preload.
"""

from __future__ import annotations

from distributed import Worker

from dask_gpu.gate import gate_worker
from dask_gpu.inventory import discover
from dask_gpu.isolation import plan_for
from dask_gpu.worker.plugin import PLUGIN_NAME, GPUWorkerPlugin
from dask_gpu.worker.sandbox import Handover
from dask_gpu.tickets import trusted_keys_from_env


async def dask_setup(worker: Worker) -> None:
    try:
        # The mode first: on a worker that may not run bodies (unisolated without its one tenant, `isolated` where
        # that cannot be had) this raises before any GPU is advertised or the plugin installed, so nothing is placed
        # there and no ticket redeemed (Dask logs a preload's error and starts the worker anyway).
        plan_for()
        inventory = discover()
        for name, quantity in inventory.resources().items():
            # Runs before registration: the scheduler learns these with the worker.
            held = worker.state.total_resources.get(name, 0.0) - worker.state.available_resources.get(name, 0.0)
            worker.state.total_resources[name] = quantity
            worker.state.available_resources[name] = quantity - held
        await worker.plugin_add(GPUWorkerPlugin(inventory, trusted_keys_from_env()), name=PLUGIN_NAME)
        # Runs the queue placed, handed over by the control plane (`gpu_run`); installed here, beside the plugin,
        # because the pass it runs imports the plugin.
        worker.plugins[PLUGIN_NAME].handover = Handover(worker)
    finally:  # whatever failed above: on TLS only the scheduler and the control plane may run code or read data here
        gate_worker(worker)
