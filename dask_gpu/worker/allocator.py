"""Which devices (or shares of a device) of one worker each running task holds.

Dask's resources are only counters: they bound how much runs at once, not
*which* device each task gets, and they cannot see that two half-GPU tasks
must land on the same device's memory. The allocator turns the counters into
concrete, non-overlapping holdings: a whole-GPU task gets devices nobody else
touches; fractional tasks share a device while their fractions sum to at most
one and their memory fits. It waits briefly rather than failing when Dask has
released a slot whose holder is still unwinding, or when the free capacity is
fragmented across devices.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from dask_gpu.errors import DeviceUnavailable
from dask_gpu.inventory import GPUDevice
from dask_gpu.request import GPURequest

LiveState = Callable[[], "dict[str, DeviceState] | None"]

_UNITS = 1_000_000  # fractions and MB as integers: no float drift in the books


class DeviceAllocator:
    """Thread-safe assignment of a worker's devices to running tasks."""

    def __init__(self, devices: tuple[GPUDevice, ...], live: LiveState | None = None) -> None:
        self._devices = devices
        self._live = live
        self._fraction = {d.key: 0 for d in devices}  # in millionths of a device
        self._memory = {d.key: 0 for d in devices}  # in MB
        self._held: dict[str, list[tuple[GPUDevice, int, int]]] = {}
        self._cond = threading.Condition()

    @staticmethod
    def _mb(gb: float) -> int:
        return int(round(gb * 1024))

    def _really_free(self, request: GPURequest) -> Callable[[GPUDevice], bool]:
        """Where live state is known, a device must also have the memory free that the request needs."""
        live = self._live() if self._live is not None and request.gpu_memory_gb else None
        if not live:
            return lambda d: True
        need = request.gpu_memory_gb or 0.0
        return lambda d: d.key not in live or live[d.key].memory_free_gb >= need

    def _named(self, request: GPURequest, keys: list[str] | None) -> list[GPUDevice] | None:
        """The devices `keys` names, if they are this worker's and could hold the request; else None (ignored)."""
        if not keys:
            return None
        by_key = {d.key: d for d in self._devices}
        named = [by_key[k] for k in keys if k in by_key]
        if len(named) != len(keys) or len(named) != request.devices_needed:
            return None
        fits = request.type_fits if request.fractional else request.device_fits
        return named if all(fits(d) for d in named) else None

    def _pick(self, request: GPURequest, named: list[GPUDevice] | None = None) -> list[tuple[GPUDevice, int, int]] | None:
        really_free = self._really_free(request)
        if named is not None:  # the queue chose these devices: exactly them, once they are free
            if not request.fractional:
                ok = all(self._fraction[d.key] == 0 and really_free(d) for d in named)
                return [(d, _UNITS, self._mb(d.memory_gb)) for d in named] if ok else None
            d, share = named[0], int(round(request.gpus * _UNITS))
            memory = self._mb(request.memory_on(d))
            if (self._fraction[d.key] + share <= _UNITS and self._memory[d.key] + memory <= self._mb(d.memory_gb)
                    and really_free(d)):
                return [(d, share, memory)]
            return None
        if not request.fractional:
            free = [d for d in self._devices
                    if request.device_fits(d) and self._fraction[d.key] == 0 and really_free(d)]
            if len(free) < request.devices_needed:
                return None
            free.sort(key=lambda d: (d.memory_gb, d.index, d.mig or 0))  # keep big devices for big requests
            chosen = sorted(free[: request.devices_needed], key=lambda d: (d.index, d.mig or 0))
            return [(d, _UNITS, self._mb(d.memory_gb)) for d in chosen]
        share = int(round(request.gpus * _UNITS))
        fits = []
        for d in self._devices:
            memory = self._mb(request.memory_on(d))
            if (request.type_fits(d) and self._fraction[d.key] + share <= _UNITS
                    and self._memory[d.key] + memory <= self._mb(d.memory_gb) and really_free(d)):
                fits.append((d, share, memory))
        if not fits:
            return None
        # Best fit: the fullest device that still fits, so whole devices stay free for whole requests.
        return [max(fits, key=lambda f: (self._fraction[f[0].key], self._memory[f[0].key], -f[0].index))]

    def acquire(self, key: str, request: GPURequest, timeout: float = 30.0,
                devices: list[str] | None = None) -> tuple[GPUDevice, ...]:
        """Give `key` its devices, all or none; wait up to `timeout` seconds for them.

        `devices` (device keys the cluster's queue chose, which knows what every run holds) are taken exactly,
        once free, when they could hold the request; otherwise the allocator chooses.
        """
        if request.gpus and not any(request.device_fits(d) for d in self._devices):
            raise DeviceUnavailable(f"task {key!r}: no device of this worker can ever hold {request.describe()}")
        with self._cond:
            if key in self._held:
                raise DeviceUnavailable(f"task {key!r} already holds devices {self.holders()[key]}")
            picked: list[tuple[GPUDevice, int, int]] | None = None
            named = self._named(request, devices)

            def ready() -> bool:
                nonlocal picked
                picked = self._pick(request, named)
                return picked is not None

            if not self._cond.wait_for(ready, timeout=timeout):
                raise DeviceUnavailable(
                    f"task {key!r}: no {request.describe()} free on this worker after "
                    f"{timeout:g}s; held: {self.holders()}"
                )
            assert picked is not None
            for d, share, memory in picked:
                self._fraction[d.key] += share
                self._memory[d.key] += memory
            self._held[key] = picked
            return tuple(d for d, _, _ in picked)

    def release(self, key: str) -> None:
        with self._cond:
            for d, share, memory in self._held.pop(key, []):
                self._fraction[d.key] -= share
                self._memory[d.key] -= memory
            self._cond.notify_all()

    def rename(self, key: str, new: str) -> None:
        """What `key` holds is held by `new` from now on (a warm body's devices, between its runs and its next)."""
        with self._cond:
            if key != new and key in self._held:
                if new in self._held:
                    raise DeviceUnavailable(f"task {new!r} already holds devices {self.holders()[new]}")
                self._held[new] = self._held.pop(key)

    def holders(self) -> dict[str, list[str]]:
        """Task key -> keys of the devices it holds now."""
        return {k: [d.key for d, _, _ in v] for k, v in self._held.items()}

    def usage(self) -> dict[str, tuple[float, float]]:
        """Device key -> (fraction in use, GB reserved): never above (1, device memory)."""
        return {d.key: (self._fraction[d.key] / _UNITS, self._memory[d.key] / 1024) for d in self._devices}
