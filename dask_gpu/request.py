"""What a task asks of a worker's GPUs, and which workers could ever give it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dask_gpu.errors import InfeasibleRequest
from dask_gpu.inventory import GPUDevice, WorkerInventory, type_resource

MIN_GPU_FRACTION = 0.01
"""The smallest share of one device a request may ask for (1/100): below it a run would hold a
device's slot and almost none of its price."""
MAX_GPU_MEMORY_GB = 16_384.0
"""More memory than any one device has, by far: a bound that refuses inf and typos."""


class GPURequest(BaseModel):
    """Whole devices on one worker (or on several whole workers), or a fraction of one device, of some types and memory.

    `gpus` is a whole number (that many devices, never shared) or a fraction
    below 1 (a share of one device). For whole devices `gpu_memory_gb` is the
    least memory each must have; for a fraction it is the memory reserved on
    the shared device (default: that fraction of it). `gpu_type` is one type or
    a tuple of acceptable types.

    `hosts` spreads whole devices over several whole workers (a multi-host job,
    one process per host, a *gang* placed all at once or not at all):
    `hosts=2, gpus=16` is 8 on each of two workers. None (the default): one
    worker, and a request wider than every worker is refused naming the
    `hosts=` that would hold it (multi-host only when asked, as Slurm's
    `--nodes` or Ray Train's `ScalingConfig`).
    """

    model_config = ConfigDict(frozen=True)

    gpus: float = Field(default=0, ge=0, allow_inf_nan=False)
    gpu_memory_gb: float | None = Field(default=None, gt=0, le=MAX_GPU_MEMORY_GB, allow_inf_nan=False)
    gpu_type: str | tuple[str, ...] | None = None
    hosts: int | None = Field(default=None, ge=1)

    @field_validator("gpus")
    @classmethod
    def _whole_or_fraction(cls, v: float) -> float:
        if v >= 1 and v != int(v):
            raise ValueError("gpus must be a whole number of devices, or a fraction of one device below 1 (0.25, 0.5)")
        if 0 < v < MIN_GPU_FRACTION:
            raise ValueError(f"gpus={v!r} is less than the smallest share of a device, {MIN_GPU_FRACTION:g}: "
                             f"ask for gpus={MIN_GPU_FRACTION:g} or more, or gpus=0 for no GPU")
        return v

    @model_validator(mode="after")
    def _hosts_fit(self) -> GPURequest:
        if self.hosts is not None and self.hosts > 1:
            if self.gpus < self.hosts or self.gpus % self.hosts:
                raise ValueError(f"hosts={self.hosts} spreads whole GPUs evenly over that many workers: gpus must be a "
                                 f"multiple of it (e.g. gpus={self.hosts * 8}, hosts={self.hosts}), got gpus={self.gpus:g}")
        return self

    @field_validator("gpu_type")
    @classmethod
    def _types_upper(cls, v: str | tuple[str, ...] | list[str] | None) -> str | tuple[str, ...] | None:
        if v is None:
            return None
        types = tuple(t.strip().upper() for t in ((v,) if isinstance(v, str) else v))
        if not types:
            raise ValueError("gpu_type must name at least one type, or be None for any")
        if not all(types):
            raise ValueError(f"gpu_type={v!r} has an empty name: name a type (e.g. 'H100'), or pass None for any")
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

    def fitting(self, inventory: WorkerInventory) -> int:
        """How many of this worker's devices could hold (a share of) the request."""
        return sum(1 for d in inventory.devices if self.device_fits(d))

    def fits(self, inventory: WorkerInventory) -> bool:
        """Could this worker alone ever hold the request (all devices free)?"""
        return (self.hosts or 1) == 1 and self.fitting(inventory) >= self.devices_needed

    def gang(self) -> bool:
        """Whether the request runs on several whole workers: only when it asks for them (`hosts` > 1). A request
        wider than every worker without `hosts` is refused (a body written for one process must not run twice)."""
        return (self.hosts or 1) > 1

    def member(self, gpus: int) -> GPURequest:
        """What one member of a gang holds on its worker: `gpus` whole devices of the same kind."""
        return GPURequest(gpus=gpus, gpu_memory_gb=self.gpu_memory_gb, gpu_type=self.gpu_type)

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
        parts = [f"gpus={self.gpus:g}"] + ([f"hosts={self.hosts}"] if self.hosts is not None else [])
        if self.gpu_type:
            parts.append(f"gpu_type={self.gpu_type!r}")
        if self.gpu_memory_gb:
            parts.append(f"gpu_memory_gb={self.gpu_memory_gb:g}")
        return ", ".join(parts)


def split(gpus: int, capacities: list[int]) -> list[int] | None:
    """GPUs of each gang member: as even as the members' capacities allow (water-filling); None if they cannot hold it.

    >>> split(16, [8, 8]), split(12, [8, 8]), split(10, [8, 2]), split(10, [4, 4])
    ([8, 8], [6, 6], [8, 2], None)
    """
    if sum(capacities) < gpus or not capacities:
        return None
    shares = [0] * len(capacities)
    left, open_ = gpus, sorted(range(len(capacities)), key=lambda i: capacities[i])
    while open_:
        even = left // len(open_)
        i = open_[0]
        if capacities[i] <= even:  # the smallest cannot take an even share: it takes all it has
            shares[i] = capacities[i]
            left -= capacities[i]
            open_.pop(0)
            continue
        extra = left - even * len(open_)
        for j in sorted(open_):  # the remainder goes to the first members (rank 0 first)
            shares[j] = even + (1 if extra > 0 else 0)
            extra -= 1
        return shares
    return shares if left == 0 else None


def gang_workers(request: GPURequest, inventories: dict[str, WorkerInventory]) -> list[str]:
    """The workers that could be members of the gang `request` is (`hosts=N`: each member needs gpus/N fitting
    devices, and N such workers must exist); raise if there are not enough."""
    if request.fractional:
        raise InfeasibleRequest(f"request ({request.describe()}): a fraction of a GPU runs on one worker; hosts= "
                                "needs whole GPUs")
    hosts = request.hosts or 1
    need = int(request.gpus) // hosts
    members = _members(request, inventories, need)
    if len(members) >= hosts > 1:
        return members
    have = ", ".join(f"{w}: {request.fitting(inv)}" for w, inv in inventories.items()) or "no workers"
    wanted = f"{hosts} workers with {need} fitting GPUs each"
    addr, largest = _largest(inventories)
    raise InfeasibleRequest(
        f"request ({request.describe()}) fits no worker of the cluster, and no multi-host gang either: it needs "
        f"{wanted}; the largest worker {addr} has {largest.describe()}, and the GPUs that fit per worker are: {have}. "
        "Lower gpus or hosts, change gpu_type/gpu_memory_gb, or add GPU workers")


def _largest(inventories: dict[str, WorkerInventory]) -> tuple[str, WorkerInventory]:
    return max(inventories.items(),
               key=lambda kv: (len(kv[1].devices), max((d.memory_gb for d in kv[1].devices), default=0)))


def _members(request: GPURequest, inventories: dict[str, WorkerInventory], need: int) -> list[str]:
    """The workers that could each hold `need` of the request's devices: a gang's possible members."""
    return [w for w, inv in inventories.items() if request.fitting(inv) >= need]


def _hosts_that_would_hold(request: GPURequest, inventories: dict[str, WorkerInventory]) -> int | None:
    """The fewest hosts over which the request's whole GPUs spread evenly on workers of this cluster (None: none)."""
    if request.fractional or request.gpus < 2:
        return None
    for hosts in range(2, int(request.gpus) + 1):
        if int(request.gpus) % hosts == 0 and len(_members(request, inventories, int(request.gpus) // hosts)) >= hosts:
            return hosts
    return None


def eligible_workers(request: GPURequest, inventories: dict[str, WorkerInventory]) -> list[str]:
    """Names of the workers that could hold `request` (a gang: that could be its members); raise if there are none.

    Plain Dask would leave such a task waiting forever in `no-worker`; here it
    fails at once, naming the largest worker so the fix is obvious. A request
    with `hosts` > 1 is a gang over whole workers; one wider than every worker
    without it is refused, naming the `hosts=` that would hold it.
    """
    fits = [addr for addr, inv in inventories.items() if request.fits(inv)]
    if fits:
        return fits
    if inventories and request.gang():
        return gang_workers(request, inventories)
    if not inventories:
        raise InfeasibleRequest(
            f"request ({request.describe()}) cannot be placed: the cluster has no workers; "
            "start GPU workers (LocalGPUCluster, or `dask worker --preload dask_gpu.worker.preload`)"
        )
    addr, largest = _largest(inventories)
    hosts = _hosts_that_would_hold(request, inventories)
    if hosts:  # it would fit as a gang, but it did not ask to run as several processes on several hosts
        raise InfeasibleRequest(
            f"request ({request.describe()}) is wider than every worker (the largest, {addr}, has "
            f"{largest.describe()}), and it did not ask for several hosts: a task body written for one process "
            f"would run as {hosts}. Fix: ask for hosts={hosts} (gpus={request.gpus:g}, hosts={hosts}: "
            f"{int(request.gpus) // hosts} GPUs on each of {hosts} whole workers, one process per host, "
            "torchrun's rendezvous in its environment) if the task is a multi-host job, or lower gpus")
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
