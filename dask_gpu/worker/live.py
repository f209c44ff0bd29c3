"""Live state of a worker's devices, sampled from NVML where it is present.

Declared devices have no live state (None): placement then relies on
reservations alone. Real devices also answer what is actually in use, so a
device that another process has filled is not handed out as free, and each
run's evidence carries what its devices were doing.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from dask_gpu.inventory import GPUDevice, WorkerInventory


class DeviceState(BaseModel):
    """One sample of one device."""

    model_config = ConfigDict(frozen=True)

    key: str
    utilization_pct: float | None  # None for MIG instances: NVML reports utilisation per GPU
    memory_used_gb: float
    memory_free_gb: float


def sample(inventory: WorkerInventory) -> dict[str, DeviceState] | None:
    """Device key -> state now, or None when the inventory is declared or NVML is absent."""
    if inventory.source != "nvml" or not inventory.devices:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        return {d.key: _sample_one(pynvml, d) for d in inventory.devices}
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def _sample_one(pynvml: object, device: GPUDevice) -> DeviceState:
    nv = pynvml
    handle = nv.nvmlDeviceGetHandleByIndex(device.index)  # type: ignore[attr-defined]
    utilization: float | None = None
    if device.mig is not None:
        handle = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, device.mig)  # type: ignore[attr-defined]
    else:
        utilization = float(nv.nvmlDeviceGetUtilizationRates(handle).gpu)  # type: ignore[attr-defined]
    memory = nv.nvmlDeviceGetMemoryInfo(handle)  # type: ignore[attr-defined]
    return DeviceState(key=device.key, utilization_pct=utilization,
                       memory_used_gb=round(memory.used / 2**30, 3), memory_free_gb=round(memory.free / 2**30, 3))
