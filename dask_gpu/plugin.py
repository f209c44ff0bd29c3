"""The worker plugin that owns a worker's inventory and its device allocator."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from distributed.diagnostics.plugin import WorkerPlugin

from dask_gpu.allocator import DeviceAllocator
from dask_gpu.inventory import WorkerInventory
from dask_gpu.live import DeviceState, sample

if TYPE_CHECKING:
    from distributed import Worker

PLUGIN_NAME = "dask-gpu"


class GPUWorkerPlugin(WorkerPlugin):
    """Installed on each GPU-aware worker by `dask_gpu.preload`."""

    name = PLUGIN_NAME

    def __init__(self, inventory: WorkerInventory) -> None:
        self.inventory = inventory
        self.allocator = DeviceAllocator(inventory.devices, live=self.sample)
        self._stops: dict[str, threading.Event] = {}
        self._started: dict[str, float] = {}  # key -> monotonic time it got its devices
        self._stops_lock = threading.Lock()

    def stop_event(self, key: str) -> threading.Event:
        """The event that asks task `key` to stop; it may be set before the task starts."""
        with self._stops_lock:
            return self._stops.setdefault(key, threading.Event())

    def request_stop(self, key: str) -> None:
        self.stop_event(key).set()

    def mark_started(self, key: str) -> None:
        self._started[key] = time.monotonic()

    def running_for(self, keys: list[str]) -> dict[str, float]:
        """Seconds each of `keys` has run here since it got its devices (absent: not running here)."""
        now = time.monotonic()
        return {k: now - self._started[k] for k in keys if k in self._started}

    def forget(self, key: str) -> None:
        with self._stops_lock:
            self._stops.pop(key, None)
            self._started.pop(key, None)

    def sample(self) -> dict[str, DeviceState] | None:
        """Live per-device utilisation and memory (NVML), or None for declared devices."""
        return sample(self.inventory)

    def setup(self, worker: Worker) -> None:
        self.worker_address = worker.address
