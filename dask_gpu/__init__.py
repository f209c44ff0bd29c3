"""GPU-aware Dask: inventories, GPU workers, device assignment. No Prefect needed.

The public names below are imported on first use (dask_gpu.lazy), not with the package: each lives in the folder of
the process it runs in (scheduler/, worker/, body/, client/), and a body that imports `dask_gpu.body.current` must
not load the worker's plugin or its ticket registry through this `__init__`. `from dask_gpu import X` works as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dask_gpu.lazy import public_names

_WHERE = {
    "GPUQueuePlugin": "dask_gpu.scheduler.queue",
    "install_queue": "dask_gpu.scheduler.queue",
    "LocalGPUCluster": "dask_gpu.client.cluster",
    "WorkerView": "dask_gpu.client.cluster",
    "cluster_inventories": "dask_gpu.client.cluster",
    "cluster_view": "dask_gpu.client.cluster",
    "cluster_states": "dask_gpu.client.cluster",
    "end_warm": "dask_gpu.client.cluster",
    "renew_leases": "dask_gpu.client.cluster",
    "request_stop": "dask_gpu.client.cluster",
    "running_for": "dask_gpu.client.cluster",
    "worker_addresses": "dask_gpu.client.cluster",
    "DaskGPUError": "dask_gpu.errors",
    "DeviceUnavailable": "dask_gpu.errors",
    "InfeasibleRequest": "dask_gpu.errors",
    "InventorySpecError": "dask_gpu.errors",
    "NotOnGPUWorker": "dask_gpu.errors",
    "StopRequested": "dask_gpu.errors",
    "WorkerDied": "dask_gpu.errors",
    "checkpoint": "dask_gpu.body.current",
    "current_devices": "dask_gpu.body.current",
    "stop_requested": "dask_gpu.body.current",
    "DeviceRun": "dask_gpu.worker.execute",
    "current_worker": "dask_gpu.worker.execute",
    "current_worker_name": "dask_gpu.worker.execute",
    "gpu_env": "dask_gpu.worker.execute",
    "hold_devices": "dask_gpu.worker.execute",
    "run_subprocess": "dask_gpu.worker.execute",
    "run_with_devices": "dask_gpu.worker.execute",
    "submit": "dask_gpu.worker.execute",
    "DECLARED_ENV": "dask_gpu.inventory",
    "GPUDevice": "dask_gpu.inventory",
    "WorkerInventory": "dask_gpu.inventory",
    "declared_worker_inventories": "dask_gpu.inventory",
    "discover": "dask_gpu.inventory",
    "nvml_inventory": "dask_gpu.inventory",
    "parse_declared": "dask_gpu.inventory",
    "Rendezvous": "dask_gpu.body.gang",
    "rendezvous": "dask_gpu.body.gang",
    "torchrun_args": "dask_gpu.body.gang",
    "IsolationError": "dask_gpu.isolation",
    "IsolationPlan": "dask_gpu.isolation",
    "IsolationSettings": "dask_gpu.isolation",
    "TenantRefused": "dask_gpu.isolation",
    "DeviceState": "dask_gpu.worker.live",
    "GPURequest": "dask_gpu.request",
    "eligible_workers": "dask_gpu.request",
    "worker_restriction": "dask_gpu.request",
}

__all__ = sorted(_WHERE)
__getattr__, __dir__ = public_names(__name__, _WHERE, globals())

if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from dask_gpu.scheduler.queue import GPUQueuePlugin, install_queue
    from dask_gpu.client.cluster import LocalGPUCluster, WorkerView, cluster_inventories, cluster_view, cluster_states, end_warm, renew_leases, request_stop, running_for, worker_addresses
    from dask_gpu.errors import DaskGPUError, DeviceUnavailable, InfeasibleRequest, InventorySpecError, NotOnGPUWorker, StopRequested, WorkerDied
    from dask_gpu.body.current import checkpoint, current_devices, stop_requested
    from dask_gpu.worker.execute import DeviceRun, current_worker, current_worker_name, gpu_env, hold_devices, run_subprocess, run_with_devices, submit
    from dask_gpu.inventory import DECLARED_ENV, GPUDevice, WorkerInventory, declared_worker_inventories, discover, nvml_inventory, parse_declared
    from dask_gpu.body.gang import Rendezvous, rendezvous, torchrun_args
    from dask_gpu.isolation import IsolationError, IsolationPlan, IsolationSettings, TenantRefused
    from dask_gpu.worker.live import DeviceState
    from dask_gpu.request import GPURequest, eligible_workers, worker_restriction
