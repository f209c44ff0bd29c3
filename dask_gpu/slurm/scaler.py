"""Worker jobs that follow the cluster's queue: Slurm jobs submitted with dask-jobqueue, given back when idle.

`dask-gpu-slurm CONFIG` (dask_gpu.slurm.cli) runs a `SlurmScaler`: every `interval_seconds` it reads what waits in
the cluster's queue and what each worker holds (dask_gpu.scheduler.backlog, on the scheduler), asks the pure policy
(dask_gpu.slurm.scaling) what to do, submits the jobs it says with dask-jobqueue's `SLURMJob` (the job class
`SLURMCluster` submits, here pointed at the project's own scheduler, `dask-gpu-scheduler`, with one job template per
worker group: its `--gres`, its tenant) and gives back the ones it says: the worker is retired from the scheduler
first (nothing is placed on it any more), then its job is cancelled. A job that ended outside the scaler (`scancel`,
its time limit, a node gone) is forgotten with Slurm's word for it, and replaced if the queue still needs it.

Each job runs `python -m dask_gpu.worker.cli SCHEDULER --tls-dir DIR --trust-key KEY [--tenant T] [--declared D]`:
inside the job the worker advertises exactly the job's GPUs and its job id (dask_gpu.slurm.allocation).

dask-jobqueue is an optional extra (`pip install 'aisched-prefect[slurm]'`); only this module imports it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dask_gpu.errors import DaskGPUError
from dask_gpu.scheduler.backlog import backlog_on_scheduler
from dask_gpu.slurm.capacity import Capacity, GroupCapacity, PendingJob, publish_on_scheduler
from dask_gpu.slurm.jobs import SETTLE_SECONDS, job_end, queue_states
from dask_gpu.slurm.scaling import Plan, ScalingPolicy, Waiting, WorkerGroup, WorkerJob, plan

LEFT_SECONDS = 2 * SETTLE_SECONDS  # a job whose worker left is Slurm's to end before the scaler gives it back

logger = logging.getLogger("dask_gpu.slurm")


class SlurmScalerError(DaskGPUError):
    """The scaler's configuration is wrong, or dask-jobqueue is missing."""


class ScalerSettings(BaseModel):
    """The scaler's configuration file (YAML), as `dask-gpu-slurm CONFIG` reads it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    scheduler: str  # the address workers and the scaler reach the scheduler at, e.g. tls://login1:8786
    tls_dir: str  # the cluster's TLS files: the scaler uses client.*, the workers get ca.pem, cluster.*
    trust_keys: tuple[str, ...] = Field(min_length=1)  # the control plane's public key(s), as `aisched serve` prints
    policy: ScalingPolicy
    interval_seconds: float = Field(default=2.0, gt=0)
    python: str = sys.executable  # the Python (with the project installed) the worker jobs run
    log_directory: str | None = None  # where Slurm writes each job's output (default: Slurm's, the submit folder)
    local_directory: str | None = None  # the workers' scratch folder (dask worker --local-directory)
    job_script_prologue: tuple[str, ...] = ()  # lines the job script runs first (module load ..., source venv)

    @model_validator(mode="after")
    def _one_tenant_each(self) -> ScalerSettings:
        """A worker in a Slurm job cannot isolate tenants, so it serves one (dask_gpu.isolation): a group without a
        tenant would submit jobs whose workers refuse to start, again and again."""
        for g in self.policy.groups:
            if g.tenant is None and "--isolation" not in " ".join(g.worker_args):
                raise ValueError(f"group {g.name} names no tenant: its workers run unisolated in their Slurm jobs and "
                                 "serve one tenant, so they would refuse to start. Fix: give it `tenant: NAME`, or "
                                 "`worker_args: [--isolation, shared]` where one trusted team uses every group")
        return self


def load_settings(path: str | Path) -> ScalerSettings:
    """Read and check a scaler configuration; a bad field is named, with what to write instead."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise SlurmScalerError(f"cannot read the scaler configuration {path}: {exc}. Fix: give the path of a YAML "
                               "file (docs/how-to/slurm-kubernetes.md shows one)") from None
    except yaml.YAMLError as exc:
        raise SlurmScalerError(f"{path} is not YAML: {exc}. Fix: see docs/how-to/slurm-kubernetes.md") from None
    try:
        return ScalerSettings.model_validate(raw or {})
    except ValidationError as exc:
        what = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
                         for e in exc.errors())
        raise SlurmScalerError(f"{path}: {what}. Fix: correct those fields (docs/how-to/slurm-kubernetes.md lists "
                               "them)") from None


def slurm_job_class() -> Any:
    try:
        from dask_jobqueue.slurm import SLURMJob
    except ImportError:
        raise SlurmScalerError("dask-jobqueue is not installed. Fix: pip install 'aisched-prefect[slurm]'") from None
    return SLURMJob


class SlurmScaler:
    """Submits and gives back worker jobs as the queue asks; `step()` once, `run()` until stopped."""

    def __init__(self, settings: ScalerSettings) -> None:
        self.settings = settings
        self.groups = {g.name: g for g in settings.policy.groups}
        self.jobs: dict[str, tuple[WorkerGroup, Any]] = {}  # worker name -> its group and SLURMJob
        self.joined: set[str] = set()  # names whose worker joined at least once
        self._idle_since: dict[str, float] = {}
        self._left_since: dict[str, float] = {}  # names whose joined worker left while Slurm still lists the job
        self._numbers = itertools.count(1)
        self._stamp = f"{os.getpid():x}"
        self.client: Any = None
        self.ended: list[dict[str, str]] = []  # jobs that ended outside the scaler, with Slurm's word

    async def __aenter__(self) -> SlurmScaler:
        from distributed import Client

        from dask_gpu.security import ClusterTLS

        slurm_job_class()  # missing dask-jobqueue fails here, before anything is submitted
        self.client = await Client(self.settings.scheduler, asynchronous=True, set_as_default=False,
                                   security=ClusterTLS(Path(self.settings.tls_dir)).security("client"))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self, give_back: bool = True) -> None:
        """Give back every job (cancelled in Slurm), then disconnect."""
        if give_back:
            for name in list(self.jobs):
                await self._give_back(name, "the scaler stopped")
        if self.client is not None:
            await self.client.close()
            self.client = None

    async def step(self) -> Plan:
        """Read the queue, decide, act, then tell admission what can be started: one turn of the loop. Every Slurm
        command runs off the event loop (dask-jobqueue's own are subprocesses it awaits; squeue and scontrol here
        run in a thread)."""
        snap = await self.client.run_on_scheduler(backlog_on_scheduler)
        if not snap["queue"]:
            logger.warning("the scheduler has no cluster queue (dask-gpu-queue): nothing tells what waits. Fix: start "
                           "it with dask-gpu-scheduler, and the control plane with the queue on")
        states = await self._forget_ended(snap["workers"])
        now = time.monotonic()
        views = []
        for name, (group, job) in self.jobs.items():
            worker = snap["workers"].get(name)
            if worker is None and name in self.joined:
                # Its worker left and Slurm still lists the job (COMPLETING after a scancel, a time limit): it is
                # ending, not pending; Slurm's word ends it next (`_forget_ended`). Counted, offering nothing, and
                # given back only if Slurm keeps it that way past LEFT_SECONDS.
                left = now - self._left_since.setdefault(name, now)
                views.append(WorkerJob(name=name, group=group.name, job_id=job.job_id, joined=True,
                                       idle=left if left >= LEFT_SECONDS else None))
                continue
            if worker is None:
                views.append(WorkerJob(name=name, group=group.name, job_id=job.job_id))
                continue
            self._left_since.pop(name, None)
            self.joined.add(name)
            if worker["busy"]:
                self._idle_since.pop(name, None)
                idle = None
            else:
                idle = now - self._idle_since.setdefault(name, now)
            views.append(WorkerJob(name=name, group=group.name, job_id=job.job_id, joined=True, idle=idle,
                                   room=tuple(worker.get("room", ()))))
        waiting = [Waiting(tenant=w["tenant"], gpus=w["gpus"], width=w["width"],
                           types=tuple(w["types"]) if w["types"] else None) for w in snap["waiting"]]
        decision = plan(self.settings.policy, waiting, views)
        for group_name, n in decision.submit.items():
            for _ in range(n):
                await self._submit(self.groups[group_name], decision.backlog[group_name])
        for name in decision.cancel:
            why = (f"idle for {self.settings.policy.idle_seconds:g}s or more" if name in snap["workers"]
                   else f"its worker left {LEFT_SECONDS:g}s ago or more and Slurm still lists it" if name in self.joined
                   else "still pending")
            await self._give_back(name, f"{why}, nothing waits for its group",
                                  address=snap["workers"].get(name, {}).get("address"))
        await self.publish(snap["workers"], None if any(decision.submit.values()) else states)  # new jobs: ask again
        return decision

    def capacity(self, workers: dict[str, Any], states: dict[str, tuple[str, str]] | None) -> Capacity:
        """What admission may count on: the groups, the bounds, and Slurm's word for each of its jobs (those whose
        worker joined: RUNNING, its worker joined)."""
        p = self.settings.policy
        jobs = []
        for name, (group, job) in self.jobs.items():
            if not job.job_id:
                continue
            joined = ("RUNNING", "its worker joined") if name in workers else ("PENDING", "")
            state, reason = joined if name in workers else (states or {}).get(job.job_id, joined)
            jobs.append(PendingJob(job_id=job.job_id, group=group.name, state=state, reason=reason))
        return Capacity(groups=tuple(GroupCapacity(name=g.name, gpu_type=g.gpu_type, gpus=g.gpus, tenant=g.tenant,
                                                   max_jobs=g.max_jobs, gpu_memory_gb=g.gpu_memory_gb,
                                                   start_seconds=g.start_seconds)
                                     for g in p.groups),
                        max_jobs=p.max_jobs, start_seconds=p.start_seconds, jobs=tuple(jobs), at=time.time(),
                        fresh_seconds=max(30.0, 5 * self.settings.interval_seconds))

    async def publish(self, workers: dict[str, Any], states: dict[str, tuple[str, str]] | None = None) -> None:
        """Publish the capacity on the scheduler (only a client-certificate holder may: the operator's scaler)."""
        if states is None:
            ids = [job.job_id for _, job in self.jobs.values() if job.job_id]
            states = await asyncio.to_thread(queue_states, ids)
        await self.client.run_on_scheduler(publish_on_scheduler,
                                           capacity=self.capacity(workers, states).model_dump(mode="json"))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.step()
            except Exception:  # a turn that failed (the scheduler restarting): the next one tries again
                logger.exception("scaling step failed; trying again in %.0fs", self.settings.interval_seconds)
            try:
                await asyncio.wait_for(stop.wait(), self.settings.interval_seconds)
            except asyncio.TimeoutError:
                pass

    def _job(self, group: WorkerGroup, name: str) -> Any:
        s = self.settings
        args = ["--tls-dir", s.tls_dir, *[a for k in s.trust_keys for a in ("--trust-key", k)]]
        if group.tenant:
            args += ["--tenant", group.tenant]
        if group.declared:
            args += ["--declared", f"'{group.declared}'"]
        return slurm_job_class()(
            scheduler=s.scheduler, name=name, job_name=f"dask-gpu-{group.name}", cores=group.cores,
            memory=group.memory, processes=1, queue=group.partition, walltime=group.walltime,
            job_directives_skip=[] if group.walltime else ["-t "],
            job_extra_directives=[f"--gres={group.gres_request}", *group.job_extra_directives],
            worker_command="dask_gpu.worker.cli", python=s.python, worker_extra_args=[*args, *group.worker_args],
            log_directory=s.log_directory, local_directory=s.local_directory,
            job_script_prologue=list(s.job_script_prologue), death_timeout=60)

    async def _submit(self, group: WorkerGroup, backlog: int) -> None:
        name = f"{group.name}-{self._stamp}-{next(self._numbers)}"
        job = self._job(group, name)
        await job.start()
        self.jobs[name] = (group, job)
        logger.warning("submitted Slurm job %s (%s, --gres=%s) for group %s: its waiting runs need %d job(s)",
                       job.job_id, name, group.gres_request, group.name, backlog)

    async def _give_back(self, name: str, why: str, address: str | None = None) -> None:
        group, job = self.jobs.pop(name)
        self._idle_since.pop(name, None)
        self._left_since.pop(name, None)
        self.joined.discard(name)
        if address and self.client is not None:
            try:  # nothing is placed on it any more, whatever the queue decides meanwhile
                await asyncio.wait_for(self.client.retire_workers([address], close_workers=True), 30)
            except Exception:
                logger.warning("retiring worker %s failed; cancelling its job anyway", name)
        await job.close()
        logger.warning("gave back Slurm job %s (%s, group %s): %s", job.job_id, name, group.name, why)

    async def _forget_ended(self, workers: dict[str, Any]) -> dict[str, tuple[str, str]] | None:
        """Forget jobs that ended outside the scaler (scancel, time limit, node gone): Slurm no longer lists them.
        Returns what squeue said of the live ones (state, reason), None where it could not be asked."""
        ids = {job.job_id: name for name, (_, job) in self.jobs.items() if job.job_id}
        live = await asyncio.to_thread(queue_states, list(ids))
        if live is None:  # squeue could not be asked: keep every job rather than submit twice
            return None
        for job_id, name in ids.items():
            if job_id in live or name in workers:
                continue
            group, _ = self.jobs.pop(name)
            self._idle_since.pop(name, None)
            self._left_since.pop(name, None)
            self.joined.discard(name)
            end = await asyncio.to_thread(job_end, job_id)
            self.ended.append({"name": name, "group": group.name, **end.model_dump()})
            logger.warning("worker job %s (%s) ended outside the scaler: %s", job_id, name, end.describe())
        return live


__all__ = ["ScalerSettings", "SlurmScaler", "SlurmScalerError", "load_settings"]
