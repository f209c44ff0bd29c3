"""What the code running now was given: its devices and its stop event (context variables, per thread or body).

Kept apart from the worker-side modules so a body's process can set them
without importing the worker's plugin, and those modules can read them without
importing the body's.
"""

from __future__ import annotations

import threading
from contextvars import ContextVar

from dask_gpu.errors import NotOnGPUWorker, StopRequested
from dask_gpu.inventory import GPUDevice

current_devices_var: ContextVar[tuple[GPUDevice, ...] | None] = ContextVar("dask_gpu_current_devices", default=None)
current_stop_var: ContextVar[threading.Event | None] = ContextVar("dask_gpu_current_stop", default=None)


def current_devices() -> tuple[GPUDevice, ...]:
    """The devices held by the task running in this thread (or this body's process)."""
    devices = current_devices_var.get()
    if devices is None:
        raise NotOnGPUWorker(
            "current_devices() was called outside a GPU task: call it inside a function "
            "submitted through dask_gpu.submit or an @ai_task"
        )
    return devices


def stop_requested() -> bool:
    """Whether the task running in this thread has been asked to stop."""
    stop = current_stop_var.get()
    return stop is not None and stop.is_set()


def checkpoint() -> None:
    """A cooperative stop point for Python code in a long task: raises StopRequested when asked to stop."""
    if stop_requested():
        raise StopRequested("the task was asked to stop (authority revoked or preempted)")
