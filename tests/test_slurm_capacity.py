"""Admission that counts capacity that can be started: the scaler's groups beside the joined workers (pure units;
tests/test_slurm.py runs it on a real Slurm)."""

from __future__ import annotations

import time

import pytest

from aisched_prefect.control.admission import capacity
from aisched_prefect.control.admission import stages
from aisched_prefect.errors import AdmissionDenied
from aisched_prefect.request import AIRequest
from dask_gpu.inventory import GPUDevice, WorkerInventory
from dask_gpu.slurm.capacity import Capacity, GroupCapacity, PendingJob, capacity_on_scheduler, publish_on_scheduler

H100 = WorkerInventory(devices=(GPUDevice(index=0, uuid="u0", name="H100", gpu_type="H100", memory_gb=80),),
                       tenant="team-a")
CAP = Capacity(groups=(GroupCapacity(name="a100-1", gpu_type="A100", gpus=1, max_jobs=2, gpu_memory_gb=40),
                       GroupCapacity(name="h100-c", gpu_type="H100", gpus=2, tenant="team-c", max_jobs=1)),
               max_jobs=3, start_seconds=90, at=time.time())


def admit(request: AIRequest, tenant: str, inventories: dict[str, WorkerInventory] | None = None):
    """Stage 1 as the plane runs it: the joined workers first, then the scaler's groups."""
    invs = {"h100-a": H100, **(inventories if inventories is not None else CAP.inventories())}
    try:
        return stages.feasibility(request, capacity.joined_only(invs), tenant)
    except AdmissionDenied as refused:
        return capacity.feasible(stages.feasibility, request, invs, tenant, refused)


def test_a_gpu_type_only_a_group_at_zero_jobs_has_waits_for_that_group():
    workers, types = admit(AIRequest(kind="training", gpus=1, gpu_type="A100", est_seconds=60), "team-a")
    assert capacity.waits_for_capacity(workers) == ["a100-1"] and types == ["A100"]
    assert len(workers) == 2  # one stand-in per job the group may start (its max_jobs, within the operator's)


def test_a_tenant_whose_group_is_at_zero_jobs_waits_for_it():
    workers, _ = admit(AIRequest(kind="training", gpus=2, gpu_type="H100", est_seconds=60), "team-c")
    assert capacity.waits_for_capacity(workers) == ["h100-c"]
    # team-a's run of the same shape goes to its joined worker... no: it needs 2 GPUs, the joined worker has 1, and
    # the 2-GPU group serves team-c only: refused, naming both
    with pytest.raises(AdmissionDenied) as refused:
        admit(AIRequest(kind="training", gpus=2, gpu_type="H100", est_seconds=60), "team-a")
    assert "h100-c (H100 x2, team-c)" in refused.value.reason and "a100-1" in refused.value.reason


def test_a_run_the_joined_workers_hold_does_not_wait_for_capacity():
    workers, _ = admit(AIRequest(kind="training", gpus=1, gpu_type="H100", est_seconds=60), "team-a")
    assert workers == ["h100-a"] and capacity.waits_for_capacity(workers) == []


def test_a_run_no_group_could_hold_is_refused_at_once_naming_what_is_missing():
    for request in (AIRequest(kind="training", gpus=1, gpu_type="B200", est_seconds=60),
                    AIRequest(kind="training", gpus=1, gpu_type="A100", gpu_memory_gb=80, est_seconds=60),
                    AIRequest(kind="training", gpus=4, gpu_type="A100", est_seconds=60)):
        with pytest.raises(AdmissionDenied) as refused:
            admit(request, "team-a")
        assert refused.value.stage == "feasibility" and "no worker group of dask-gpu-slurm" in refused.value.reason
        assert "adds such a group" in refused.value.fix
    with pytest.raises(AdmissionDenied) as refused:  # no scaler publishing: the joined workers' answer, as before
        admit(AIRequest(kind="training", gpus=1, gpu_type="A100", est_seconds=60), "team-a", inventories={})
    assert "no worker has GPU type 'A100'" in refused.value.reason and "dask-gpu-slurm" not in refused.value.reason


def test_a_gang_counts_the_jobs_a_group_may_start_within_the_operators_total():
    wide = Capacity(groups=(GroupCapacity(name="a100-1", gpu_type="A100", gpus=1, max_jobs=4),), max_jobs=2,
                    at=time.time())
    workers, _ = admit(AIRequest(kind="training", gpus=2, gpu_type="A100", hosts=2, est_seconds=60), "team-a",
                       wide.inventories())
    assert capacity.waits_for_capacity(workers) == ["a100-1"]
    with pytest.raises(AdmissionDenied):  # three hosts: the operator's total allows two jobs
        admit(AIRequest(kind="training", gpus=3, gpu_type="A100", hosts=3, est_seconds=60), "team-a",
              wide.inventories())


def test_what_a_run_waits_for_is_said_in_slurms_words_and_a_stale_publication_counts_as_none():
    assert CAP.waiting_for(["a100-1"]) == "no Slurm job of group a100-1 was submitted yet (dask-gpu-slurm submits one)"
    cap = CAP.model_copy(update={"jobs": (PendingJob(job_id="41", group="a100-1", reason="Resources"),)})
    assert cap.waiting_for(["a100-1"]) == "a Slurm job of group a100-1 was submitted: job 41, pending: Resources"
    # CAP's `at` is the collection time, minutes before this runs on a busy host: the clock is given, not read.
    assert cap.fresh(now=cap.at + 1) and not cap.fresh(now=cap.at + cap.fresh_seconds + 1)
    assert not CAP.model_copy(update={"at": time.time() - 600}).fresh()

    class Scheduler:
        pass

    s = Scheduler()
    assert capacity_on_scheduler(s) is None
    publish_on_scheduler(s, cap.model_dump(mode="json"))
    assert Capacity.model_validate(capacity_on_scheduler(s)) == cap
