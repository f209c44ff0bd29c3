"""GPU-aware Dask: inventories, GPU workers, device assignment. No Prefect needed.

The public names below are imported on first use (dask_gpu.lazy), not with the package: each lives in the folder of
the process it runs in (scheduler/, worker/, body/, client/), and a body that imports `dask_gpu.body.current` must
not load the worker's plugin or its ticket registry through this `__init__`. `from dask_gpu import X` works as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dask_gpu.lazy import public_names

# Each module, and the public names it gives the package.
_FROM = {
    "dask_gpu.scheduler.queue": "GPUQueuePlugin install_queue",
    "dask_gpu.client.cluster": (
        "LocalGPUCluster WorkerView cluster_inventories cluster_view cluster_states end_warm "
        "renew_leases request_stop running_for worker_addresses"
    ),
    "dask_gpu.errors": (
        "DaskGPUError DeviceUnavailable InfeasibleRequest InventorySpecError NotOnGPUWorker "
        "StopRequested WorkerDied"
    ),
    "dask_gpu.body.current": "checkpoint current_devices stop_requested",
    "dask_gpu.body.placement": "current_worker current_worker_name gpu_env run_subprocess",
    "dask_gpu.worker.execute": "DeviceRun hold_devices run_with_devices submit",
    "dask_gpu.inventory": (
        "DECLARED_ENV GPUDevice WorkerInventory declared_worker_inventories discover "
        "nvml_inventory parse_declared"
    ),
    "dask_gpu.body.gang": "Rendezvous rendezvous torchrun_args",
    "dask_gpu.isolation": "IsolationError IsolationPlan IsolationSettings TenantRefused",
    "dask_gpu.worker.live": "DeviceState",
    "dask_gpu.request": "GPURequest eligible_workers worker_restriction",
}
_WHERE = {name: module for module, names in _FROM.items() for name in names.split()}

__all__ = sorted(_WHERE)
__getattr__, __dir__ = public_names(__name__, _WHERE, globals())

if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from dask_gpu.scheduler.queue import GPUQueuePlugin, install_queue
    from dask_gpu.client.cluster import (
        LocalGPUCluster, WorkerView, cluster_inventories, cluster_view, cluster_states, end_warm, renew_leases,
        request_stop, running_for, worker_addresses,
    )
    from dask_gpu.errors import (
        DaskGPUError, DeviceUnavailable, InfeasibleRequest, InventorySpecError, NotOnGPUWorker, StopRequested,
        WorkerDied,
    )
    from dask_gpu.body.current import checkpoint, current_devices, stop_requested
    from dask_gpu.body.placement import current_worker, current_worker_name, gpu_env, run_subprocess
    from dask_gpu.worker.execute import DeviceRun, hold_devices, run_with_devices, submit
    from dask_gpu.inventory import (
        DECLARED_ENV, GPUDevice, WorkerInventory, declared_worker_inventories, discover, nvml_inventory,
        parse_declared,
    )
    from dask_gpu.body.gang import Rendezvous, rendezvous, torchrun_args
    from dask_gpu.isolation import IsolationError, IsolationPlan, IsolationSettings, TenantRefused
    from dask_gpu.worker.live import DeviceState
    from dask_gpu.request import GPURequest, eligible_workers, worker_restriction
