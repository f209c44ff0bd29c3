"""Which devices of one worker each running task holds.

Dask's `GPU` resource is only a counter: it guarantees that no more tasks run
than there are devices, but not *which* device each one gets. The allocator
turns the counter into disjoint device sets. It blocks briefly rather than
failing when Dask has released a slot whose previous holder is still
unwinding (a cancelled task's thread keeps running until it returns).
"""

from __future__ import annotations

import threading

from dask_gpu.errors import DeviceUnavailable
from dask_gpu.inventory import GPUDevice
from dask_gpu.request import GPURequest


class DeviceAllocator:
    """Thread-safe assignment of a worker's devices to running tasks."""

    def __init__(self, devices: tuple[GPUDevice, ...]) -> None:
        self._devices = devices
        self._held: dict[str, tuple[GPUDevice, ...]] = {}
        self._cond = threading.Condition()

    def _pick(self, request: GPURequest) -> tuple[GPUDevice, ...] | None:
        taken = {d.index for held in self._held.values() for d in held}
        free = [d for d in self._devices if d.index not in taken and request.device_fits(d)]
        if len(free) < request.gpus:
            return None
        # Smallest fitting devices first: keep the big ones for the requests that need them.
        free.sort(key=lambda d: (d.memory_gb, d.index))
        return tuple(sorted(free[: request.gpus], key=lambda d: d.index))

    def acquire(self, key: str, request: GPURequest, timeout: float = 30.0) -> tuple[GPUDevice, ...]:
        """Give `key` its devices, all or none; wait up to `timeout` seconds for them."""
        if request.gpus and not self._devices:
            raise DeviceUnavailable(f"task {key!r} asked for {request.describe()} on a worker with no GPUs")
        with self._cond:
            if key in self._held:
                raise DeviceUnavailable(f"task {key!r} already holds devices {self._held[key]}")
            picked: tuple[GPUDevice, ...] | None = None

            def ready() -> bool:
                nonlocal picked
                picked = self._pick(request)
                return picked is not None

            if not self._cond.wait_for(ready, timeout=timeout):
                raise DeviceUnavailable(
                    f"task {key!r}: no {request.describe()} free on this worker after "
                    f"{timeout:g}s; held: {self.holders()}"
                )
            assert picked is not None
            self._held[key] = picked
            return picked

    def release(self, key: str) -> None:
        with self._cond:
            self._held.pop(key, None)
            self._cond.notify_all()

    def holders(self) -> dict[str, list[int]]:
        """Task key -> device indices held now."""
        return {k: [d.index for d in v] for k, v in self._held.items()}
