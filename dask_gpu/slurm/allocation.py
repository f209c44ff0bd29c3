"""What a Slurm job gave the worker that runs in it: its job id, its GPUs and their GRES type.

A `dask-gpu-worker` started inside a Slurm job (SLURM_JOB_ID in its environment) advertises exactly the GPUs of its
allocation, whatever the node has: `discover()` restricts NVML's devices or the declared ones to the indexes in
SLURM_JOB_GPUS (CUDA_VISIBLE_DEVICES where Slurm set no SLURM_JOB_GPUS), names their type from the job's GRES
(`--gres=gpu:h100:2` -> H100) where it has one, and puts the job id into the worker's inventory, so that each run's
evidence names the Slurm job it ran in (`placement.slurm_job`), beside what `sacct` and `squeue` say.

Where the GRES type comes from: DASK_GPU_SLURM_GPU_TYPE if the job script sets it, else the job's own record
(`scontrol show job -o $SLURM_JOB_ID`, its TresPerNode / TresPerJob), read once at the worker's start; with neither, the
type stays what NVML or the declared inventory says.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict

from dask_gpu.errors import InventorySpecError

GPU_TYPE_ENV = "DASK_GPU_SLURM_GPU_TYPE"
_GRES = re.compile(r"gres[:/]gpu:(?P<type>[A-Za-z][\w.-]*)(?::|=)\d+")


class SlurmAllocation(BaseModel):
    """The part of a Slurm job a GPU worker advertises."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    gpus: tuple[int, ...] | None = None  # the allocation's GPU indexes on this node (None: the job has no GPU list)
    gpu_type: str | None = None  # the GRES type, upper case (None: not known)
    user: str = ""
    node: str = ""


def parse_indexes(text: str, source: str) -> tuple[int, ...]:
    """'0,1' or '0-2,5' -> (0, 1) or (0, 1, 2, 5); a malformed list names its variable."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, sep, last = part.partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise InventorySpecError(f"{source}={text!r} is not a list of GPU indexes (as '0,1' or '0-3'). Fix: start "
                                     "the worker inside the Slurm job as Slurm set it, or unset it")
        out.extend(range(int(first), int(last) + 1) if sep else [int(first)])
    return tuple(out)


def gres_type(text: str) -> str | None:
    """The GPU type in a job's GRES or TRES text ('gres:gpu:h100:2', 'gres/gpu:h100=2'), upper case; None if none."""
    m = _GRES.search(text or "")
    return m.group("type").upper() if m else None


def job_gres(job_id: str, env: Mapping[str, str]) -> str:
    """The job's own GRES request as Slurm holds it (`scontrol show job -o`); '' where scontrol cannot tell."""
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol is None:
        return ""
    try:
        out = subprocess.run([scontrol, "show", "job", "-o", job_id], capture_output=True, text=True, timeout=15,
                             env=dict(env))
    except (OSError, subprocess.TimeoutExpired):
        return ""
    fields = dict(re.findall(r"(\w+)=(\S*)", out.stdout)) if out.returncode == 0 else {}
    return " ".join(fields.get(k, "") for k in ("TresPerNode", "TresPerJob", "TresPerTask"))


def allocation(env: Mapping[str, str] | None = None, ask_slurm: bool = True) -> SlurmAllocation | None:
    """This process's Slurm allocation, or None outside a Slurm job (no SLURM_JOB_ID)."""
    env = os.environ if env is None else env
    job_id = (env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "").strip()
    if not job_id:
        return None
    gpus = None
    for name in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES"):
        if env.get(name) is not None and not (name == "CUDA_VISIBLE_DEVICES" and "GPU-" in env[name]):
            gpus = parse_indexes(env[name], name)
            break
    gpu_type = (env.get(GPU_TYPE_ENV) or "").strip().upper() or None
    if gpu_type is None and ask_slurm:
        gpu_type = gres_type(job_gres(job_id, env))
    return SlurmAllocation(job_id=job_id, gpus=gpus, gpu_type=gpu_type, user=env.get("SLURM_JOB_USER", ""),
                           node=env.get("SLURMD_NODENAME", ""))


__all__ = ["GPU_TYPE_ENV", "SlurmAllocation", "allocation", "gres_type", "parse_indexes"]
