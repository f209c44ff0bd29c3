"""Running a function on the devices a worker assigned to it."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from distributed import get_worker
from distributed.worker import thread_state
from pydantic import BaseModel, ConfigDict

from dask_gpu.client.cluster import cluster_inventories
from dask_gpu.body.current import current_devices, current_devices_var, current_stop_var
# What a body calls lives on the body side (a body must not import Dask to learn its worker); here for the worker.
from dask_gpu.body.placement import current_worker, current_worker_name, gpu_env, run_subprocess  # noqa: F401
from dask_gpu.errors import InfeasibleRequest, NotOnGPUWorker, StopRequested
from dask_gpu.inventory import GPUDevice, WorkerInventory
from dask_gpu.worker.live import DeviceState
from dask_gpu.worker.plugin import PLUGIN_NAME, GPUWorkerPlugin
from dask_gpu.request import GPURequest, worker_restriction

DEVICE_WAIT_SECONDS = 30.0


class DeviceRun(BaseModel):
    """Where and how long a function ran: the placement half of the evidence."""

    model_config = ConfigDict(frozen=True)

    worker: str
    host: str
    devices: tuple[GPUDevice, ...] = ()
    name: str = ""  # the worker's name: kept when its nanny restarts it at a new address
    started_at: float
    seconds: float
    source: str = "none"
    live: dict[str, DeviceState] | None = None  # NVML sample of its devices as it ended
    slurm_job: str | None = None  # the Slurm job its worker runs in (None: not in one)

    @property
    def device_keys(self) -> list[str]:
        """'0', '1', ... for whole GPUs; '0:1' for MIG instance 1 of GPU 0."""
        return [d.key for d in self.devices]

    @property
    def gpu_type(self) -> str | None:
        return self.devices[0].gpu_type if self.devices else None


def _plugin() -> tuple[str, GPUWorkerPlugin | None]:
    try:
        worker = get_worker()
    except ValueError as exc:
        raise NotOnGPUWorker("run_with_devices must run on a Dask worker") from exc
    plugin = worker.plugins.get(PLUGIN_NAME)
    return worker.address, plugin if isinstance(plugin, GPUWorkerPlugin) else None


class DeviceLease:
    """The devices one call holds; `run` describes the call once it has ended."""

    def __init__(self, address: str, plugin: GPUWorkerPlugin | None, devices: tuple[GPUDevice, ...]) -> None:
        self.address = address
        self.plugin = plugin
        self.devices = devices
        self.started_at = time.time()
        self._t0 = time.perf_counter()
        self.seconds: float | None = None
        self.live: dict[str, DeviceState] | None = None

    def run(self) -> DeviceRun:
        seconds = self.seconds if self.seconds is not None else time.perf_counter() - self._t0
        return DeviceRun(
            worker=self.address,
            name=self.plugin.worker_name if self.plugin else "",
            host=self.plugin.inventory.host if self.plugin else "",
            devices=self.devices,
            started_at=self.started_at,
            seconds=seconds,
            source=self.plugin.inventory.source if self.plugin else "none",
            live=self.live,
            slurm_job=self.plugin.inventory.slurm_job if self.plugin else None,
        )


@contextmanager
def hold_devices(request: GPURequest, devices: list[str] | None = None,
                 held: tuple[GPUDevice, ...] | None = None, key: str | None = None) -> Iterator[DeviceLease]:
    """Hold the devices `request` needs on this worker for the block; release them however it ends.

    `devices`: the device keys the cluster's queue chose (taken exactly, when they can hold the request).
    `held`: devices the caller already holds for longer than the block (a body's, for its whole life: see
    dask_gpu.worker.bodies); the block runs on them and neither takes nor gives them back.
    `key`: what the hold and its stop are known by (default: the Dask task's key; a run handed over names its own).
    """
    address, plugin = _plugin()
    if request.gpus and plugin is None:
        raise NotOnGPUWorker(
            f"worker {address} is not GPU-aware: start it with `--preload dask_gpu.worker.preload`"
        )
    key = str(key or getattr(thread_state, "key", None) or f"call-{threading.get_ident()}-{time.monotonic_ns()}")
    stop = plugin.stop_event(key) if plugin is not None else threading.Event()
    if stop.is_set():
        if plugin is not None:
            plugin.forget(key)
        raise StopRequested(f"task {key!r} was asked to stop before it started")
    own = held is None and bool(request.gpus) and plugin is not None
    if own:
        assert plugin is not None
        held = plugin.allocator.acquire(key, request, timeout=DEVICE_WAIT_SECONDS, devices=devices)
    held = held or ()
    lease = DeviceLease(address, plugin, held)
    if plugin is not None:
        plugin.mark_started(key)
    token, stop_token = current_devices_var.set(held), current_stop_var.set(stop)
    try:
        yield lease
    finally:
        lease.seconds = time.perf_counter() - lease._t0
        if held and plugin is not None:
            states = plugin.sample()
            lease.live = {d.key: states[d.key] for d in held if d.key in states} if states else None
        current_devices_var.reset(token)
        current_stop_var.reset(stop_token)
        if plugin is not None:
            plugin.forget(key)
        if own and plugin is not None:
            plugin.allocator.release(key)


def run_with_devices(
    fn: Callable[..., Any],
    request: GPURequest,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
) -> tuple[Any, DeviceRun]:
    """Call `fn` on the devices `request` needs; return its result and where it ran."""
    with hold_devices(request) as lease:
        result = fn(*args, **(kwargs or {}))
    return result, lease.run()


def _call(fn: Callable[..., Any], request: GPURequest, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return run_with_devices(fn, request, args, kwargs)[0]


def submit(client: Any, fn: Callable[..., Any], *args: Any, request: GPURequest,
           inventories: dict[str, WorkerInventory] | None = None, **kwargs: Any) -> Any:
    """Plain-Dask entry point: `client.submit` that places by GPU count, type and memory and assigns devices.

    Fails at once (InfeasibleRequest) when no worker could ever hold `request`.
    Pass `inventories` (from `cluster_inventories(client)`) to skip reading them
    on every call.
    """
    if not request.gpus:
        return client.submit(_call, fn, request, args, kwargs, pure=False)
    inventories = cluster_inventories(client) if inventories is None else inventories
    if request.gang():
        raise InfeasibleRequest(f"request ({request.describe()}) needs several whole workers (a multi-host job): "
                                "run it as an @ai_task, whose control plane places it on whole workers all at once")
    return client.submit(_call, fn, request, args, kwargs, resources=request.resources(),
                         workers=worker_restriction(request, inventories), allow_other_workers=False, pure=False)
