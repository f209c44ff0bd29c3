"""GPU-aware Dask: inventories, GPU workers, device assignment. No Prefect needed."""

from dask_gpu.queue_plugin import GPUQueuePlugin, install_queue
from dask_gpu.cluster import LocalGPUCluster, cluster_inventories, cluster_states, request_stop, running_for
from dask_gpu.errors import (
    DaskGPUError,
    DeviceUnavailable,
    InfeasibleRequest,
    InventorySpecError,
    NotOnGPUWorker,
    StopRequested,
)
from dask_gpu.execute import (
    DeviceRun,
    checkpoint,
    current_devices,
    gpu_env,
    hold_devices,
    run_subprocess,
    run_with_devices,
    stop_requested,
    submit,
)
from dask_gpu.inventory import (
    DECLARED_ENV,
    GPUDevice,
    WorkerInventory,
    declared_worker_inventories,
    discover,
    nvml_inventory,
    parse_declared,
)
from dask_gpu.live import DeviceState
from dask_gpu.request import GPURequest, eligible_workers, worker_restriction

__all__ = [
    "GPUQueuePlugin",
    "DECLARED_ENV",
    "DaskGPUError",
    "DeviceRun",
    "DeviceState",
    "DeviceUnavailable",
    "GPUDevice",
    "GPURequest",
    "InfeasibleRequest",
    "InventorySpecError",
    "LocalGPUCluster",
    "NotOnGPUWorker",
    "StopRequested",
    "WorkerInventory",
    "checkpoint",
    "cluster_inventories",
    "cluster_states",
    "current_devices",
    "declared_worker_inventories",
    "discover",
    "eligible_workers",
    "gpu_env",
    "hold_devices",
    "nvml_inventory",
    "parse_declared",
    "run_subprocess",
    "install_queue",
    "request_stop",
    "running_for",
    "run_with_devices",
    "stop_requested",
    "submit",
    "worker_restriction",
]
