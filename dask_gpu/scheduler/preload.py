"""Dask scheduler preload for a GPU cluster: `dask scheduler --preload dask_gpu.scheduler.preload`.

What `dask-gpu-scheduler` starts with, and what `LocalGPUCluster` gives its
scheduler:

- `allowed_failures = 0`: a task whose worker dies fails at once (KilledWorker)
  instead of being re-run silently; the control plane records the attempt and
  the flow's `retries=` decides. (The control plane does not rely on it: it
  also notices a worker's death by itself, on a scheduler left at Dask's default.)
- the ticket registry: each admission ticket is redeemed once cluster-wide, and
  it tells the control plane which runs (and devices) a dead worker took with it;
- the queue plugin: the cluster's one queue of GPU runs;
- the model limits: per-model concurrency and rate slots, shared by every control plane replica;
- on TLS, the gate: only the control plane's certificate may become a client or run code (dask_gpu.gate).
"""

from __future__ import annotations

from typing import Any

from dask_gpu.scheduler.limits import PLUGIN_NAME as LIMITS_NAME, ModelLimits
from dask_gpu.scheduler.queue import PLUGIN_NAME as QUEUE_NAME, GPUQueuePlugin
from dask_gpu.tickets import REGISTRY_NAME, TicketRegistry


def configure(scheduler: Any) -> None:
    from dask_gpu.gate import gate_scheduler

    gate_scheduler(scheduler)
    scheduler.allowed_failures = 0
    if REGISTRY_NAME not in scheduler.plugins:
        scheduler.add_plugin(TicketRegistry(), name=REGISTRY_NAME)
    if QUEUE_NAME not in scheduler.plugins:
        scheduler.add_plugin(GPUQueuePlugin(), name=QUEUE_NAME)
    if LIMITS_NAME not in scheduler.plugins:
        scheduler.add_plugin(ModelLimits(), name=LIMITS_NAME)


def dask_setup(scheduler: Any) -> None:
    configure(scheduler)
