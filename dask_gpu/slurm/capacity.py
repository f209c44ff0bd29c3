"""Capacity that can be started: the scaler's worker groups, as admission counts them before any of their jobs runs.

`dask-gpu-slurm` (dask_gpu.slurm.scaler) publishes its groups on the scheduler every turn (`publish_on_scheduler`,
through `client.run_on_scheduler`, which on a TLS cluster only the holder of the client certificate may call: the
operator's scaler or the control plane, never a flow), with its own bounds (its `max_jobs` over all groups, how long a
run may wait for a job of a group to join: `start_seconds`) and Slurm's word for each of its jobs (the
state and reason `squeue` gives). The control plane reads it with the workers' inventories (`read_capacity`): a run
that only a group at 0 jobs could hold is admitted as waiting for capacity (aisched_prefect/control/admission/capacity.py).

What is published is the operator's configuration file, seen through the scaler: a flow never writes it. A
publication older than its `fresh_seconds` (the scaler stopped) counts as none: no run waits for a scaler that is gone.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dask_gpu.inventory import GPUDevice, WorkerInventory

ATTRIBUTE = "dask_gpu_capacity"  # where the publication lives on the scheduler object
CAPACITY_PREFIX = "slurm-group:"  # a worker name that stands for a job a group can start (no worker has it)
UNLIMITED_GB = 1e6  # a group that states no GPU memory: the worker that joins decides (the queue checks it)


class GroupCapacity(BaseModel):
    """One worker group as admission counts it: what one of its jobs would hold."""

    model_config = ConfigDict(frozen=True)

    name: str
    gpu_type: str
    gpus: int = Field(ge=1)
    tenant: str | None = None
    max_jobs: int = Field(ge=1)
    gpu_memory_gb: float | None = None
    start_seconds: float | None = None  # how long a run waits for this group's first worker (None: the scaler's)


class PendingJob(BaseModel):
    """A worker job the scaler submitted, as Slurm tells it (state and reason; a joined worker's: RUNNING)."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    group: str
    state: str = "PENDING"
    reason: str = ""


class Capacity(BaseModel):
    """The scaler's groups and bounds, and its jobs not yet joined, at time `at` (seconds since the epoch)."""

    model_config = ConfigDict(frozen=True)

    groups: tuple[GroupCapacity, ...] = ()
    max_jobs: int = Field(default=1, ge=1)
    start_seconds: float = Field(default=600.0, gt=0)
    jobs: tuple[PendingJob, ...] = ()
    at: float = 0.0
    fresh_seconds: float = Field(default=30.0, gt=0)
    scaler: str = "dask-gpu-slurm"

    def fresh(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) - self.at <= self.fresh_seconds

    def inventories(self) -> dict[str, WorkerInventory]:
        """One stand-in worker per job each group may start (within the operator's total): what feasibility reads."""
        out: dict[str, WorkerInventory] = {}
        for g in self.groups:
            memory = g.gpu_memory_gb or UNLIMITED_GB
            devices = tuple(GPUDevice(index=i, uuid=f"{CAPACITY_PREFIX}{g.name}-{i}", name=g.gpu_type,
                                      gpu_type=g.gpu_type, memory_gb=memory) for i in range(g.gpus))
            for n in range(min(g.max_jobs, self.max_jobs)):
                out[f"{CAPACITY_PREFIX}{g.name}#{n}"] = WorkerInventory(devices=devices, source="declared",
                                                                         host=f"(a Slurm job of group {g.name})",
                                                                         tenant=g.tenant)
        return out

    def bound(self, groups: list[str]) -> float:
        """How long a run admitted for `groups` waits for a worker of one of them: the longest of their bounds."""
        return max((g.start_seconds or self.start_seconds for g in self.groups if g.name in groups),
                   default=self.start_seconds)

    def waiting_for(self, groups: list[str]) -> str:
        """Where the jobs of `groups` stand, in Slurm's words: what a run waiting for them waits for."""
        mine = [j for j in self.jobs if j.group in groups]
        if not mine:
            return f"no Slurm job of group {' or '.join(groups)} was submitted yet ({self.scaler} submits one)"
        return "; ".join(f"a Slurm job of group {j.group} was submitted: job {j.job_id}, "
                         f"{j.state.lower()}{': ' + j.reason if j.reason and j.reason != 'None' else ''}"
                         for j in mine)


def groups_of(workers: list[str]) -> list[str]:
    """The groups named by stand-in workers (`slurm-group:NAME#N`), in order, once each."""
    out: list[str] = []
    for w in workers:
        if w.startswith(CAPACITY_PREFIX):
            name = w[len(CAPACITY_PREFIX):].split("#", 1)[0]
            if name not in out:
                out.append(name)
    return out


def publish_on_scheduler(dask_scheduler: Any, capacity: dict[str, Any]) -> None:
    """Runs on the scheduler (client.run_on_scheduler): keep the scaler's latest publication."""
    setattr(dask_scheduler, ATTRIBUTE, capacity)


def capacity_on_scheduler(dask_scheduler: Any) -> dict[str, Any] | None:
    """Runs on the scheduler: the latest publication, or None."""
    return getattr(dask_scheduler, ATTRIBUTE, None)


def read_capacity(client: Any) -> Capacity | None:
    """The scaler's fresh publication, through a synchronous client; None where there is none (or it is stale)."""
    try:
        raw = client.run_on_scheduler(capacity_on_scheduler)
    except Exception:  # an older scheduler, or one that does not answer: no capacity beyond the workers
        return None
    if not raw:
        return None
    cap = Capacity.model_validate(raw)
    return cap if cap.fresh() else None


__all__ = ["CAPACITY_PREFIX", "Capacity", "GroupCapacity", "PendingJob", "capacity_on_scheduler", "groups_of",
           "publish_on_scheduler", "read_capacity"]
