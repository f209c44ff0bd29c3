"""GPU-aware Dask: inventories, GPU workers, device assignment. No Prefect needed."""

from dask_gpu.scheduler.queue import GPUQueuePlugin, install_queue
from dask_gpu.client.cluster import (
    LocalGPUCluster,
    WorkerView,
    cluster_inventories,
    cluster_view,
    cluster_states,
    end_warm,
    renew_leases,
    request_stop,
    running_for,
    worker_addresses,
)
from dask_gpu.errors import (
    DaskGPUError,
    DeviceUnavailable,
    InfeasibleRequest,
    InventorySpecError,
    NotOnGPUWorker,
    StopRequested,
    WorkerDied,
)
from dask_gpu.body.current import checkpoint, current_devices, stop_requested
from dask_gpu.worker.execute import (
    DeviceRun,
    current_worker,
    current_worker_name,
    gpu_env,
    hold_devices,
    run_subprocess,
    run_with_devices,
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
from dask_gpu.body.gang import Rendezvous, rendezvous, torchrun_args
from dask_gpu.isolation import IsolationError, IsolationPlan, IsolationSettings, TenantRefused
from dask_gpu.worker.live import DeviceState
from dask_gpu.request import GPURequest, eligible_workers, worker_restriction

__all__ = [
    "GPUQueuePlugin",
    "DECLARED_ENV",
    "DaskGPUError",
    "DeviceRun",
    "DeviceState",
    "DeviceUnavailable",
    "Rendezvous",
    "GPUDevice",
    "GPURequest",
    "InfeasibleRequest",
    "InventorySpecError",
    "IsolationError",
    "IsolationPlan",
    "IsolationSettings",
    "TenantRefused",
    "LocalGPUCluster",
    "NotOnGPUWorker",
    "StopRequested",
    "WorkerInventory",
    "checkpoint",
    "WorkerView",
    "cluster_inventories",
    "cluster_view",
    "cluster_states",
    "end_warm",
    "current_devices",
    "current_worker",
    "current_worker_name",
    "declared_worker_inventories",
    "discover",
    "eligible_workers",
    "gpu_env",
    "hold_devices",
    "nvml_inventory",
    "parse_declared",
    "run_subprocess",
    "install_queue",
    "renew_leases",
    "rendezvous",
    "request_stop",
    "running_for",
    "run_with_devices",
    "stop_requested",
    "submit",
    "torchrun_args",
    "worker_addresses",
    "worker_restriction",
    "WorkerDied",
]
