"""What GPUs a worker has: read from NVML, or declared where there are none.

Both sources produce the same `WorkerInventory`; everything above this module
(resources, placement, device assignment) never knows which one it got.
"""

from __future__ import annotations

import os
import re
import socket

from pydantic import BaseModel, ConfigDict, Field

from dask_gpu.errors import InventorySpecError

DECLARED_ENV = "DASK_GPU_DECLARED"
"""Environment variable holding a declared inventory, e.g. ``"2 workers x 2 GPUs, 80 GB, H100"``."""

DEFAULT_DECLARED_TYPE = "H100"
DEFAULT_DECLARED_MEMORY_GB = 80.0


class GPUDevice(BaseModel):
    """One device as a task sees it: its NVML index (and MIG instance), identity and size."""

    model_config = ConfigDict(frozen=True)

    index: int = Field(ge=0)
    uuid: str
    name: str
    gpu_type: str
    memory_gb: float = Field(gt=0)
    mig: int | None = Field(default=None, ge=0)

    @property
    def key(self) -> str:
        """Unique within a worker: '0' for a whole GPU, '0:1' for MIG instance 1 of GPU 0."""
        return str(self.index) if self.mig is None else f"{self.index}:{self.mig}"

    @property
    def visible_id(self) -> str:
        """What CUDA_VISIBLE_DEVICES needs: the physical index, or the UUID of a MIG instance."""
        return str(self.index) if self.mig is None else self.uuid


class WorkerInventory(BaseModel):
    """The devices of one worker and where they came from."""

    model_config = ConfigDict(frozen=True)

    devices: tuple[GPUDevice, ...] = ()
    source: str = "declared"  # "nvml" or "declared"
    host: str = Field(default_factory=socket.gethostname)

    @property
    def gpu_types(self) -> set[str]:
        return {d.gpu_type for d in self.devices}

    def describe(self) -> str:
        if not self.devices:
            return "no GPUs"
        kinds: dict[tuple[str, float], int] = {}
        for d in self.devices:
            kinds[(d.gpu_type, d.memory_gb)] = kinds.get((d.gpu_type, d.memory_gb), 0) + 1
        return ", ".join(f"{n} x {t} {m:g} GB" for (t, m), n in sorted(kinds.items()))

    def resources(self) -> dict[str, float]:
        """The Dask worker resources this inventory advertises."""
        res: dict[str, float] = {"GPU": float(len(self.devices))}
        for d in self.devices:
            key = type_resource(d.gpu_type)
            res[key] = res.get(key, 0.0) + 1.0
        res["GPU-MEMORY-GB"] = float(sum(d.memory_gb for d in self.devices))
        return res


def type_resource(gpu_type: str) -> str:
    """Dask resource name counting the devices of one GPU type."""
    return f"GPU-{gpu_type.upper()}"


class DeclaredGroup(BaseModel):
    """`workers` identical workers, each with `gpus` devices of one type and size."""

    model_config = ConfigDict(frozen=True)

    workers: int = Field(default=1, ge=1)
    gpus: int = Field(ge=0)
    gpu_type: str = DEFAULT_DECLARED_TYPE
    memory_gb: float = Field(default=DEFAULT_DECLARED_MEMORY_GB, gt=0)

    def inventory(self) -> WorkerInventory:
        return WorkerInventory(
            source="declared",
            devices=tuple(
                GPUDevice(
                    index=i,
                    uuid=f"GPU-declared-{self.gpu_type.lower()}-{i}",
                    name=f"Declared {self.gpu_type}",
                    gpu_type=self.gpu_type,
                    memory_gb=self.memory_gb,
                )
                for i in range(self.gpus)
            ),
        )

    def spec(self) -> str:
        return f"1x{self.gpus} {self.gpu_type} {self.memory_gb:g}GB"


_COUNTS = re.compile(
    r"^\s*(?:(?P<workers>\d+)\s*(?:workers?)?\s*[x×*]\s*)?(?P<gpus>\d+)\s*(?:gpus?)?\b", re.I
)
_MEMORY = re.compile(r"(?P<mem>\d+(?:\.\d+)?)\s*(?:gb|gib|g)\b", re.I)
_TYPE = re.compile(r"\b(?P<type>[A-Za-z][A-Za-z0-9_.-]*)\b")
_NOT_A_TYPE = {"x", "gpu", "gpus", "worker", "workers", "gb", "gib", "g"}


def parse_declared(spec: str) -> list[DeclaredGroup]:
    """Parse ``"2 workers x 2 GPUs, 80 GB, H100; 1x4 A10 24GB"`` into groups.

    Groups are separated by ``;``. In each, the counts come first
    (``WORKERS x GPUS`` or just ``GPUS``), then in any order a memory size in GB
    and a GPU type name. Type and memory default to H100 and 80 GB.
    """
    groups: list[DeclaredGroup] = []
    for part in (p for p in spec.split(";") if p.strip()):
        counts = _COUNTS.match(part)
        if counts is None:
            raise InventorySpecError(
                f"declared GPU inventory {part.strip()!r}: expected the counts first, as in "
                f"'2 workers x 2 GPUs, 80 GB, H100' or '2x2 H100 80GB' (set {DECLARED_ENV} "
                "or the `declared=` argument)"
            )
        rest = part[counts.end():]
        mem = _MEMORY.search(rest)
        rest_wo_mem = _MEMORY.sub(" ", rest)
        types = [m for m in _TYPE.findall(rest_wo_mem) if m.lower() not in _NOT_A_TYPE]
        if len(types) > 1:
            raise InventorySpecError(
                f"declared GPU inventory {part.strip()!r}: found several GPU types {types}; "
                "write one group per type, separated by ';'"
            )
        groups.append(
            DeclaredGroup(
                workers=int(counts.group("workers") or 1),
                gpus=int(counts.group("gpus")),
                gpu_type=types[0] if types else DEFAULT_DECLARED_TYPE,
                memory_gb=float(mem.group("mem")) if mem else DEFAULT_DECLARED_MEMORY_GB,
            )
        )
    if not groups:
        raise InventorySpecError(
            f"declared GPU inventory {spec!r} is empty: write e.g. '2 workers x 2 GPUs, 80 GB, H100'"
        )
    return groups


def declared_worker_inventories(spec: str) -> list[WorkerInventory]:
    """One inventory per declared worker, in spec order."""
    return [g.inventory() for g in parse_declared(spec) for _ in range(g.workers)]


def _visible_filter(devices: list[GPUDevice]) -> list[GPUDevice]:
    """Honour a CUDA_VISIBLE_DEVICES the worker process was started with."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or visible.strip() == "":
        return devices
    wanted = [v.strip() for v in visible.split(",") if v.strip()]
    return [d for d in devices if str(d.index) in wanted or d.uuid in wanted]


def gpu_type_from_name(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100'; the first token that names a model."""
    tokens = [t for t in re.split(r"[\s_-]+", name) if t]
    skip = {"nvidia", "tesla", "geforce", "quadro", "amd", "instinct", "radeon", "rtx"}
    for t in tokens:
        if t.lower() not in skip and any(c.isdigit() for c in t):
            return t.upper()
    return tokens[-1].upper() if tokens else "GPU"


def nvml_inventory() -> WorkerInventory | None:
    """Devices NVML reports on this host, or None where NVML is absent."""
    try:
        import pynvml
    except ImportError:  # pragma: no cover - nvidia-ml-py is a dependency
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    def text(value: str | bytes) -> str:
        return value.decode() if isinstance(value, bytes) else value

    def gib(handle: object) -> float:
        return round(pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30, 2)

    try:
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = text(pynvml.nvmlDeviceGetName(h))
            gpu_type = gpu_type_from_name(name)
            try:
                mig_enabled = pynvml.nvmlDeviceGetMigMode(h)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
            except pynvml.NVMLError:  # not a MIG-capable GPU
                mig_enabled = False
            if not mig_enabled:
                devices.append(GPUDevice(index=i, uuid=text(pynvml.nvmlDeviceGetUUID(h)), name=name,
                                         gpu_type=gpu_type, memory_gb=gib(h)))
                continue
            # Each MIG instance is a device of its own, with its own memory and UUID.
            for k in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(h)):
                try:
                    m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
                except pynvml.NVMLError:
                    continue
                devices.append(GPUDevice(index=i, mig=k, uuid=text(pynvml.nvmlDeviceGetUUID(m)),
                                         name=f"{name} MIG {k}", gpu_type=gpu_type, memory_gb=gib(m)))
    finally:
        pynvml.nvmlShutdown()
    if not devices:
        return None
    return WorkerInventory(devices=tuple(_visible_filter(devices)), source="nvml")


def discover(declared: str | None = None) -> WorkerInventory:
    """This worker's inventory: the declared one if given (argument, then env), else NVML.

    A declared spec here describes one worker, so it must not ask for several.
    Where neither exists the worker has no GPUs: GPU requests then fail
    feasibility with a message that says how to declare some.
    """
    spec = declared if declared is not None else os.environ.get(DECLARED_ENV)
    if spec:
        inventories = declared_worker_inventories(spec)
        if len(inventories) != 1:
            raise InventorySpecError(
                f"{DECLARED_ENV}={spec!r} declares {len(inventories)} workers, but one worker "
                "process reads it: declare one worker here (e.g. '2 GPUs, 80 GB, H100'), "
                "or pass the multi-worker spec to LocalGPUCluster(declared=...)"
            )
        return inventories[0]
    return nvml_inventory() or WorkerInventory(source="none")
