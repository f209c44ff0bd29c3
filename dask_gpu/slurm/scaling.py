"""How many Slurm worker jobs each worker group wants, from the cluster's queue: a pure policy, no Slurm, no Dask.

The operator describes worker groups (a GPU type, the GPUs of one job, the one tenant its workers serve, at least
`min_jobs` and at most `max_jobs` jobs) and one maximum over all groups. Each step the scaler (dask_gpu.slurm.scaler)
reads what waits in the cluster's queue and what each worker holds, and `plan` answers which jobs to submit and which
to give back:

- every waiting run is counted once, for the first group (in the operator's order) that can hold it: its tenant (a
  group without one holds every tenant's runs), its GPU type (a run that names none fits any), and its size. Runs are
  counted as the queue counts them: waiting fractions of a GPU share devices (four quarter-GPU shards need one GPU,
  packed first-fit decreasing by share); a gang over `width` hosts needs `width` whole jobs (jobs held together: the
  queue starts the gang once all its workers joined); the rest, and the devices the fractions fill, are packed onto
  jobs of the group's size first-fit decreasing;
- a group submits the jobs its backlog needs beyond those already pending in Slurm and its idle workers, within its
  `max_jobs` and the operator's `max_jobs` over all groups; it keeps `min_jobs` always;
- a group with no backlog gives back its jobs beyond `min_jobs`: pending ones at once, workers once idle (nothing
  running, no warm body) for `idle_seconds`.

Only admitted runs wait in the queue (the control plane enters a run after its budget hold and grant checks), so a
job is never submitted for a run its tenant's budget or grants would refuse.
"""

from __future__ import annotations

import math
import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,30}$")


class WorkerGroup(BaseModel):
    """One kind of worker job: what it asks of Slurm and what its worker serves."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    gpu_type: str
    gpus: int = Field(default=1, ge=1)  # GPUs of one job (its --gres count)
    tenant: str | None = None  # the one tenant its workers serve (dask-gpu-worker --tenant); None: every tenant
    min_jobs: int = Field(default=0, ge=0)
    max_jobs: int = Field(default=1, ge=1)
    partition: str | None = None
    cores: int = Field(default=1, ge=1)
    memory: str = "4GB"
    walltime: str | None = None  # Slurm's --time, e.g. "04:00:00"
    gres: str | None = None  # default: gpu:TYPE:GPUS (lower-case type, as gres.conf names it)
    declared: str | None = None  # the node's GPUs for workers without NVML (dask-gpu-worker --declared)
    gpu_memory_gb: float | None = Field(default=None, gt=0)  # each GPU's memory, for admission (None: not checked then)
    start_seconds: float | None = Field(default=None, gt=0)  # the policy's start_seconds, for this group's jobs
    job_extra_directives: tuple[str, ...] = ()  # more #SBATCH lines (--account=..., --qos=...)
    worker_args: tuple[str, ...] = ()  # more dask-gpu-worker arguments

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME.match(value):
            raise ValueError(f"group name {value!r} must be lower-case letters, digits and '-', e.g. h100-team-a")
        return value

    @field_validator("gpu_type")
    @classmethod
    def _type(cls, value: str) -> str:
        return value.upper()

    @model_validator(mode="after")
    def _bounds(self) -> WorkerGroup:
        if self.min_jobs > self.max_jobs:
            raise ValueError(f"group {self.name}: min_jobs {self.min_jobs} is more than max_jobs {self.max_jobs}")
        return self

    @property
    def gres_request(self) -> str:
        return self.gres or f"gpu:{self.gpu_type.lower()}:{self.gpus}"


class ScalingPolicy(BaseModel):
    """The groups and the operator's bounds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    groups: tuple[WorkerGroup, ...] = Field(min_length=1)
    max_jobs: int = Field(default=4, ge=1)  # worker jobs over all groups, pending or running
    idle_seconds: float = Field(default=60.0, ge=0)  # a worker idle this long is given back (beyond min_jobs)
    # A run admitted for a group at 0 jobs fails (Slurm's pending reason, nothing charged) if no worker of the group
    # joined within this: the job's start time is what scale from zero costs, and this bounds it.
    start_seconds: float = Field(default=600.0, gt=0)

    @model_validator(mode="after")
    def _unique(self) -> ScalingPolicy:
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"group names must be unique: {names}")
        return self


class Waiting(BaseModel):
    """A run waiting in the cluster's queue, as the policy counts it."""

    model_config = ConfigDict(frozen=True)

    tenant: str
    gpus: float = Field(gt=0)
    width: int = 0  # a gang over this many whole hosts (0: one host)
    types: tuple[str, ...] | None = None


class WorkerJob(BaseModel):
    """One worker job the scaler submitted: pending in Slurm, or its worker joined (idle for `idle` seconds, or busy)."""

    model_config = ConfigDict(frozen=True)

    name: str
    group: str
    job_id: str | None = None
    joined: bool = False
    idle: float | None = None  # seconds its joined worker has held nothing (None: busy, or not joined)
    room: tuple[float, ...] = ()  # share left on each of its shared devices (waiting fractions fit there first)


class Plan(BaseModel):
    """What to do now: how many jobs to submit per group, which jobs to give back, and why."""

    submit: dict[str, int] = Field(default_factory=dict)
    cancel: list[str] = Field(default_factory=list)
    backlog: dict[str, int] = Field(default_factory=dict)  # jobs each group's waiting runs need
    unserved: int = 0  # waiting runs no group can hold (another tenant, type or size)

    def describe(self) -> str:
        parts = [f"{g}: +{n}" for g, n in self.submit.items() if n]
        parts += [f"give back {n}" for n in self.cancel]
        return "; ".join(parts) or "nothing to do"


def holds(group: WorkerGroup, run: Waiting) -> bool:
    """Whether a worker of `group` can hold `run` (a gang: each of its members)."""
    if group.tenant is not None and run.tenant != group.tenant:
        return False
    if run.types is not None and group.gpu_type not in {t.upper() for t in run.types}:
        return False
    return _per_host(run) <= group.gpus


def _per_host(run: Waiting) -> int:
    if run.gpus < 1:
        return 1  # a fraction opens (at most) one device
    return math.ceil(run.gpus / run.width) if run.width > 1 else math.ceil(run.gpus)


def devices_for_fractions(shares: list[float], room: tuple[float, ...] = ()) -> int:
    """New devices that hold these fractions at once, as the queue shares a device (first-fit decreasing by share),
    after the `room` left on devices already shared (the queue places waiting fractions there first)."""
    free: list[float] = list(room)
    for share in sorted(shares, reverse=True):
        for i, left in enumerate(free):
            if left + 1e-9 >= share:
                free[i] = left - share
                break
        else:
            free.append(1.0 - share)
    return len(free) - len(room)


def jobs_needed(group: WorkerGroup, runs: list[Waiting], room: tuple[float, ...] = ()) -> int:
    """Jobs of `group` that hold `runs` at once: gangs take whole jobs, fractions share devices (the `room` left on
    its workers' shared devices first), the rest and those devices packed onto jobs first-fit decreasing."""
    jobs = sum(r.width for r in runs if r.width > 1)
    singles = [r for r in runs if r.width <= 1]
    needs = [_per_host(r) for r in singles if r.gpus >= 1]
    needs += [1] * devices_for_fractions([r.gpus for r in singles if r.gpus < 1], room)
    bins: list[int] = []
    for need in sorted(needs, reverse=True):
        for i, free in enumerate(bins):
            if free >= need:
                bins[i] -= need
                break
        else:
            bins.append(group.gpus - need)
    return jobs + len(bins)


def plan(policy: ScalingPolicy, waiting: list[Waiting], jobs: list[WorkerJob]) -> Plan:
    """The jobs to submit and to give back now (see the module's docstring)."""
    out = Plan()
    mine: dict[str, list[Waiting]] = {g.name: [] for g in policy.groups}
    for run in waiting:
        group = next((g for g in policy.groups if holds(g, run)), None)
        if group is None:
            out.unserved += 1
        else:
            mine[group.name].append(run)
    total = len(jobs)
    for g in policy.groups:
        have = [j for j in jobs if j.group == g.name]
        pending = [j for j in have if not j.joined]
        idle = [j for j in have if j.joined and j.idle is not None]
        room = tuple(r for j in have if j.joined for r in j.room)
        need = out.backlog[g.name] = jobs_needed(g, mine[g.name], room) if mine[g.name] else 0
        want = max(need - len(pending) - len(idle), g.min_jobs - len(have), 0)
        free = max(min(g.max_jobs - len(have), policy.max_jobs - total), 0)
        out.submit[g.name] = min(want, free)
        total += out.submit[g.name]
        if need:
            continue
        spare = len(have) - g.min_jobs
        # pending first (nothing runs there), then the longest idle workers
        for j in pending + sorted((j for j in idle if j.idle >= policy.idle_seconds), key=lambda j: -j.idle):
            if spare <= 0:
                break
            out.cancel.append(j.name)
            spare -= 1
    return out


__all__ = ["Plan", "ScalingPolicy", "Waiting", "WorkerGroup", "WorkerJob", "devices_for_fractions", "holds",
           "jobs_needed", "plan"]
