"""Where the running body was placed: its worker's address and name, and subprocesses that see exactly its devices.

On the body's side of the worker: a body (a process of its own) reads these from the environment its worker gave it,
and imports no Dask for them (distributed is a second of imports in every tenant's zygote); only code that runs in
the worker's own threads (`run_with_devices`) falls back on Dask's `get_worker`.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from typing import Any

from dask_gpu.body.current import current_devices, current_stop_var
from dask_gpu.errors import NotOnGPUWorker, StopRequested
from dask_gpu.inventory import GPUDevice

STOP_POLL_SECONDS = 0.2


def _worker() -> Any:
    from distributed import get_worker  # in a worker's own thread only: a body has its worker in its environment

    return get_worker()


def current_worker() -> str:
    """The address of the Dask worker the running body was placed on (its body runs in a process of its own)."""
    address = os.environ.get("DASK_GPU_WORKER")
    if address:
        return address
    try:
        return _worker().address
    except ValueError:
        raise NotOnGPUWorker("current_worker() was called outside a task running on a worker") from None


def current_worker_name() -> str:
    """The name of the Dask worker the running body was placed on (`dask-gpu-worker --name`; its address if it has none).

    What logs should say: a worker restarted by its nanny keeps its name, not its address.
    """
    name = os.environ.get("DASK_GPU_WORKER_NAME")
    if name:
        return name
    try:
        return str(_worker().name)
    except ValueError:
        raise NotOnGPUWorker("current_worker_name() was called outside a task running on a worker") from None


def gpu_env(devices: Sequence[GPUDevice] | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a subprocess that must see exactly `devices` (default: the current ones)."""
    devices = current_devices() if devices is None else devices
    env = dict(os.environ if base is None else base)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA numbers devices as NVML does
    env["CUDA_VISIBLE_DEVICES"] = ",".join(d.visible_id for d in devices)
    return env


def run_subprocess(args: Sequence[str] | str, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """`subprocess.run` with CUDA_VISIBLE_DEVICES set to this task's devices, killed if the task must stop.

    Takes `subprocess.run`'s arguments (capture_output, text, check, timeout, input, ...).
    """
    kwargs["env"] = gpu_env(base=kwargs.get("env"))
    stop = current_stop_var.get()
    if stop is None:
        return subprocess.run(args, **kwargs)
    check, timeout, data = kwargs.pop("check", False), kwargs.pop("timeout", None), kwargs.pop("input", None)
    if kwargs.pop("capture_output", False):
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if data is not None:
        kwargs["stdin"] = subprocess.PIPE
    deadline = None if timeout is None else time.monotonic() + timeout
    with subprocess.Popen(args, **kwargs) as proc:
        while True:
            try:
                out, err = proc.communicate(data, timeout=STOP_POLL_SECONDS)
                break
            except subprocess.TimeoutExpired:
                data = None  # already sent; communicate() goes on where it left off
                if stop.is_set() or (deadline is not None and time.monotonic() > deadline):
                    proc.kill()
                    proc.communicate()
                    if stop.is_set():
                        raise StopRequested(f"killed {args!r}: the task was asked to stop") from None
                    raise subprocess.TimeoutExpired(args, timeout or 0) from None
    completed = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if check:
        completed.check_returncode()
    return completed
