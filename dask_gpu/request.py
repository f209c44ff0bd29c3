"""What a task asks of a worker's GPUs, and which workers could ever give it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dask_gpu.errors import InfeasibleRequest
from dask_gpu.inventory import GPUDevice, WorkerInventory, type_resource


class GPURequest(BaseModel):
    """Whole devices on one worker, or a fraction of one device, of some types and memory.

    `gpus` is a whole number (that many devices, all on one worker, never
    shared) or a fraction below 1 (a share of one device). For whole devices
    `gpu_memory_gb` is the least memory each must have; for a fraction it is
    the memory reserved on the shared device (default: that fraction of it).
    `gpu_type` is one type or a tuple of acceptable types.
    """

    model_config = ConfigDict(frozen=True)

    gpus: float = Field(default=0, ge=0)
    gpu_memory_gb: float | None = Field(default=None, gt=0)
    gpu_type: str | tuple[str, ...] | None = None

    @field_validator("gpus")
    @classmethod
    def _whole_or_fraction(cls, v: float) -> float:
        if v >= 1 and v != int(v):
            raise ValueError("gpus must be a whole number of devices, or a fraction of one device below 1 (0.25, 0.5)")
        return v

    @field_validator("gpu_type")
    @classmethod
    def _types_upper(cls, v: str | tuple[str, ...] | list[str] | None) -> str | tuple[str, ...] | None:
        if v is None:
            return None
        if isinstance(v, str):
            return v.upper()
        types = tuple(t.upper() for t in v)
        if not types:
            raise ValueError("gpu_type must name at least one type, or be None for any")
        return types[0] if len(types) == 1 else types

    @property
    def fractional(self) -> bool:
        return 0 < self.gpus < 1

    @property
    def devices_needed(self) -> int:
        return 1 if self.fractional else int(self.gpus)

    @property
    def types(self) -> tuple[str, ...] | None:
        return (self.gpu_type,) if isinstance(self.gpu_type, str) else self.gpu_type

    def type_fits(self, device: GPUDevice) -> bool:
        return self.types is None or device.gpu_type.upper() in self.types

    def device_fits(self, device: GPUDevice) -> bool:
        """Could this device, when free, hold (its share of) the request?"""
        return self.type_fits(device) and (self.gpu_memory_gb is None or device.memory_gb >= self.gpu_memory_gb)

    def memory_on(self, device: GPUDevice) -> float:
        """GPU memory this request reserves on `device`."""
        if not self.fractional:
            return device.memory_gb
        return self.gpu_memory_gb if self.gpu_memory_gb is not None else self.gpus * device.memory_gb

    def fits(self, inventory: WorkerInventory) -> bool:
        """Could this worker ever hold the request (all devices free)?"""
        return sum(1 for d in inventory.devices if self.device_fits(d)) >= self.devices_needed

    def resources(self) -> dict[str, float]:
        """Dask resource annotation: the counters Dask itself enforces before the allocator packs."""
        if self.gpus == 0:
            return {}
        res = {"GPU": float(self.gpus)}
        if isinstance(self.gpu_type, str):
            res[type_resource(self.gpu_type)] = float(self.gpus)
        if self.fractional and self.gpu_memory_gb is not None:
            res["GPU-MEMORY-GB"] = float(self.gpu_memory_gb)
        return res

    def describe(self) -> str:
        parts = [f"gpus={self.gpus:g}"]
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


def worker_restriction(request: GPURequest, inventories: dict[str, WorkerInventory],
                       eligible: list[str] | None = None) -> list[str] | None:
    """The `workers=` a submit needs: None when Dask's resource counters already say enough.

    Counters express count and one type; memory and any-of-several types need
    an explicit list of eligible workers. Raises InfeasibleRequest like
    `eligible_workers` (unless `eligible` is given, already computed).
    """
    eligible = eligible_workers(request, inventories) if eligible is None else eligible
    candidates = [a for a, inv in inventories.items() if inv.devices] if request.gpus else list(inventories)
    return None if set(eligible) == set(candidates) else eligible
