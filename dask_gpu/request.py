"""What a task asks of a worker's GPUs, and which workers could ever give it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from dask_gpu.errors import InfeasibleRequest
from dask_gpu.inventory import GPUDevice, WorkerInventory, type_resource


class GPURequest(BaseModel):
    """Whole devices on one worker, each of a type and with at least some memory."""

    model_config = ConfigDict(frozen=True)

    gpus: int = Field(default=0, ge=0)
    gpu_memory_gb: float | None = Field(default=None, gt=0)
    gpu_type: str | None = None

    def device_fits(self, device: GPUDevice) -> bool:
        if self.gpu_type is not None and device.gpu_type.upper() != self.gpu_type.upper():
            return False
        return self.gpu_memory_gb is None or device.memory_gb >= self.gpu_memory_gb

    def fits(self, inventory: WorkerInventory) -> bool:
        """Could this worker ever hold the request (all devices free)?"""
        return sum(1 for d in inventory.devices if self.device_fits(d)) >= self.gpus

    def resources(self) -> dict[str, float]:
        """Dask resource annotation: counters Dask itself enforces."""
        if self.gpus == 0:
            return {}
        res = {"GPU": float(self.gpus)}
        if self.gpu_type is not None:
            res[type_resource(self.gpu_type)] = float(self.gpus)
        return res

    def describe(self) -> str:
        parts = [f"gpus={self.gpus}"]
        if self.gpu_type:
            parts.append(f"gpu_type={self.gpu_type!r}")
        if self.gpu_memory_gb:
            parts.append(f"gpu_memory_gb={self.gpu_memory_gb:g}")
        return ", ".join(parts)


def eligible_workers(request: GPURequest, inventories: dict[str, WorkerInventory]) -> list[str]:
    """Addresses of the workers that could hold `request`; raise if there are none.

    Plain Dask would leave such a task waiting forever in `no-worker`; here it
    fails at once, naming the largest worker so the fix is obvious.
    """
    fits = [addr for addr, inv in inventories.items() if request.fits(inv)]
    if fits:
        return fits
    if not inventories:
        raise InfeasibleRequest(
            f"request ({request.describe()}) cannot be placed: the cluster has no workers; "
            "start GPU workers (LocalGPUCluster, or `dask worker --preload dask_gpu.preload`)"
        )
    addr, largest = max(
        inventories.items(),
        key=lambda kv: (len(kv[1].devices), max((d.memory_gb for d in kv[1].devices), default=0)),
    )
    raise InfeasibleRequest(
        f"request ({request.describe()}) fits no worker of the cluster; the largest worker "
        f"{addr} has {largest.describe()} ({largest.source}). Lower gpus/gpu_memory_gb, change "
        "gpu_type, or add a worker that has such devices (on a machine without GPUs, declare "
        "them: DASK_GPU_DECLARED='2 workers x 2 GPUs, 80 GB, H100')"
    )
