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
from dask_gpu.slurm.allocation import SlurmAllocation, allocation

DECLARED_ENV = "DASK_GPU_DECLARED"
"""Environment variable holding a declared inventory, e.g. ``"2 workers x 2 GPUs, 80 GB, H100"``."""

DECLARED_GRAMMAR = (
    "one or more groups separated by ';', each:  [WORKERS workers x] GPUS GPUs, MEMORY GB, TYPE\n"
    "  e.g. '2 GPUs, 80 GB, H100' (one worker), or '2 workers x 2 GPUs, 80 GB, H100; 1 worker x 4 GPUs, 24 GB, A10'"
)


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
    slurm_job: str | None = None  # the Slurm job this worker runs in (dask_gpu.slurm.allocation), None outside one
    tenant: str | None = None  # the one tenant whose bodies it runs (started with --tenant), None: any tenant

    def serves(self, tenant: str | None) -> bool:
        """Whether this worker runs bodies of `tenant` (admission and the queue place no other tenant's run here)."""
        return self.tenant is None or self.tenant == tenant

    @property
    def gpu_types(self) -> set[str]:
        return {d.gpu_type for d in self.devices}

    def describe(self) -> str:
        if self.slurm_job is not None:
            return f"{self._kinds()} (Slurm job {self.slurm_job})"
        return self._kinds()

    def _kinds(self) -> str:
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
    gpus: int = Field(ge=1)
    gpu_type: str
    memory_gb: float = Field(gt=0)

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
        """One worker of this group, in the grammar (what each worker process of a LocalGPUCluster is given)."""
        return f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}, {self.memory_gb:g} GB, {self.gpu_type}"


_TOKEN = re.compile(r"\s*(?:(?P<num>\d+(?:\.\d+)?)|(?P<word>[A-Za-z][A-Za-z0-9_.-]*)|(?P<sym>\S))")
_KEYWORDS = {"x", "worker", "workers", "gpu", "gpus", "gb"}


class _Group:
    """A recursive-descent reader of one group: each step says exactly what it expected and what it found."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:  # only trailing whitespace is left
                break
            kind = m.lastgroup or "sym"
            self.tokens.append((kind, m.group(kind)))
            pos = m.end()
        self.i = 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> tuple[str, str] | None:
        tok = self.peek()
        self.i += tok is not None
        return tok

    def found(self) -> str:
        tok = self.peek()
        return "the end" if tok is None else repr(tok[1])

    def number(self, what: str, whole: bool) -> float:
        tok = self.peek()
        if tok is None or tok[0] != "num" or (whole and "." in tok[1]):
            kind = "a whole number" if whole else "a number"
            raise ValueError(f"expected {kind} ({what}) but found {self.found()}")
        self.take()
        return float(tok[1])

    def keyword(self, *words: str, hint: str = "") -> str:
        tok = self.peek()
        if tok is None or tok[1].lower() not in words:
            raise ValueError(f"expected {' or '.join(repr(w) for w in words)}{hint} but found {self.found()}")
        self.take()
        return tok[1].lower()

    def parse(self) -> DeclaredGroup:
        first = self.number("how many GPUs, or how many workers", whole=True)
        tok = self.peek()
        word = tok[1].lower() if tok is not None else ""
        workers = 1
        if word in ("worker", "workers"):
            self.take()
            if self.peek() is not None and self.peek()[1] == ",":
                raise ValueError(f"'{first:g} {word}' must be followed by 'x' (as in '{first:g} workers x 2 GPUs, "
                                 "80 GB, H100'), not a comma: each worker's GPUs follow the 'x'")
            self.keyword("x", "×", "*", hint=" after the number of workers")
            workers = int(first)
            gpus = int(self.number("GPUs per worker", whole=True))
            self.keyword("gpus", "gpu", hint=" after the number of GPUs")
        elif word in ("gpus", "gpu"):
            self.take()
            gpus = int(first)
        elif tok is not None and (word == "x" or word.startswith("x") or tok[1] in ("×", "*")):
            raise ValueError(f"write the counts out, as in '{first:g} workers x 2 GPUs, 80 GB, H100'")
        else:
            raise ValueError(f"expected 'GPUs' after the count {first:g} but found {self.found()}")
        self.keyword(",", hint=" after the GPUs (then the memory of each GPU: it is required)")
        memory = self.number("the memory of each GPU in GB", whole=False)
        self.keyword("gb", hint=" after the memory")
        self.keyword(",", hint=" after the memory (then the GPU type: it is required)")
        tok = self.take()
        if tok is None or tok[0] != "word" or tok[1].lower() in _KEYWORDS:
            raise ValueError(f"expected the GPU type (H100, A100, A10, L4, ...) but found "
                             f"{'the end' if tok is None else repr(tok[1])}")
        if self.peek() is not None:
            raise ValueError(f"unexpected {self.found()} after the GPU type {tok[1]!r} (one type per group: write "
                             "another group after ';')")
        if workers < 1 or gpus < 1:
            raise ValueError("workers and GPUs must be at least 1")
        if memory <= 0:
            raise ValueError(f"the memory of each GPU must be more than 0 GB (got {memory:g} GB)")
        return DeclaredGroup(workers=workers, gpus=gpus, gpu_type=tok[1].upper(), memory_gb=memory)


def parse_declared(spec: str, source: str = "declared GPU inventory") -> list[DeclaredGroup]:
    """Parse ``"2 workers x 2 GPUs, 80 GB, H100; 1 worker x 4 GPUs, 24 GB, A10"`` into groups, exactly.

    The grammar (case does not matter, spaces are free)::

        spec  := group (";" group)*
        group := [WORKERS ("worker" | "workers") "x"] GPUS ("GPU" | "GPUs") "," MEMORY "GB" "," TYPE

    Memory and type are required: a spec that does not parse exactly is an
    InventorySpecError naming `source` (the setting it came from), the group,
    what was expected there, the grammar and an example.

    >>> [(g.workers, g.gpus, g.memory_gb, g.gpu_type) for g in parse_declared("2 workers x 2 GPUs, 80 GB, h100")]
    [(2, 2, 80.0, 'H100')]
    """
    groups: list[DeclaredGroup] = []
    parts = spec.split(";")
    for part in parts:
        if not part.strip():
            if len(parts) > 1 and part is not parts[-1]:
                raise InventorySpecError(f"{source} {spec!r}: an empty group between ';'.\n{DECLARED_GRAMMAR}")
            continue
        try:
            groups.append(_Group(part).parse())
        except ValueError as exc:
            where = f" in group {part.strip()!r}" if len(parts) > 1 else ""
            raise InventorySpecError(f"{source} {spec!r}{where}: {exc}.\nThe grammar is {DECLARED_GRAMMAR}") from None
    if not groups:
        raise InventorySpecError(f"{source} {spec!r} is empty.\nThe grammar is {DECLARED_GRAMMAR}")
    return groups


def declared_worker_inventories(spec: str, source: str = "declared GPU inventory") -> list[WorkerInventory]:
    """One inventory per declared worker, in spec order."""
    return [g.inventory() for g in parse_declared(spec, source) for _ in range(g.workers)]


def _visible_filter(devices: list[GPUDevice]) -> list[GPUDevice]:
    """Honour a CUDA_VISIBLE_DEVICES the worker process was started with."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_JOB_GPUS") is not None:
        return devices  # Slurm's physical indexes decide (restrict_to_allocation); its CUDA_VISIBLE_DEVICES may renumber
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


def discover(declared: str | None = None, source: str | None = None) -> WorkerInventory:
    """This worker's inventory: the declared one if given (argument, then env), else NVML.

    A declared spec here describes one worker, so it must not ask for several.
    `source` names the setting the spec came from in errors (default: `declared=`
    for the argument, DASK_GPU_DECLARED for the environment).
    Where neither exists the worker has no GPUs: GPU requests then fail
    feasibility with a message that says how to declare some.
    """
    source = source or ("declared=" if declared is not None else DECLARED_ENV)
    spec = declared if declared is not None else os.environ.get(DECLARED_ENV)
    if spec is not None and (spec.strip() or declared is not None):
        inventories = declared_worker_inventories(spec, source)
        if len(inventories) != 1:
            raise InventorySpecError(
                f"{source} {spec!r} declares {len(inventories)} workers, but one worker "
                "process reads it: declare one worker here (e.g. '2 GPUs, 80 GB, H100'), "
                "or pass the multi-worker spec to LocalGPUCluster(declared=...)"
            )
        return _in_allocation(inventories[0])
    return _in_allocation(nvml_inventory() or WorkerInventory(source="none"))


def _in_allocation(inventory: WorkerInventory) -> WorkerInventory:
    found = allocation()
    return inventory if found is None else restrict_to_allocation(inventory, found)


def restrict_to_allocation(inventory: WorkerInventory, alloc: SlurmAllocation) -> WorkerInventory:
    """The devices of `inventory` that Slurm job `alloc` was given, typed by its GRES, with the job id.

    The inventory (NVML's, or a declared one) describes the node; the allocation's indexes pick from it. A declared
    inventory with exactly as many GPUs as the allocation describes the job itself: its devices take the
    allocation's indexes. A job with no GPU list (no --gres) keeps the inventory as it is.
    """
    devices = inventory.devices
    if alloc.gpus is not None:
        wanted = set(alloc.gpus)
        picked = tuple(d for d in devices if d.index in wanted)
        if {d.index for d in picked} == wanted:
            devices = picked
        elif inventory.source == "declared" and len(devices) == len(alloc.gpus) and all(d.mig is None for d in devices):
            devices = tuple(d.model_copy(update={"index": i, "uuid": f"{d.uuid}-slurm-{i}"})
                            for d, i in zip(devices, alloc.gpus))
        else:
            have = ",".join(str(d.index) for d in devices) or "none"
            raise InventorySpecError(
                f"Slurm job {alloc.job_id} was given GPUs {','.join(map(str, alloc.gpus))} (SLURM_JOB_GPUS), but this "
                f"worker's {inventory.source} inventory has GPU indexes {have}. Fix: declare the node's GPUs "
                "(--declared 'N GPUs, M GB, TYPE' with N the node's count) or exactly the job's, or check the node's "
                "gres.conf")
    if alloc.gpu_type:
        devices = tuple(d.model_copy(update={"gpu_type": alloc.gpu_type}) for d in devices)
    return inventory.model_copy(update={"devices": devices, "slurm_job": alloc.job_id})
