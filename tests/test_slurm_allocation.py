"""A worker inside a Slurm job advertises its allocation: units, no Slurm needed (tests/test_slurm.py runs the real one)."""

from __future__ import annotations

import pytest

from dask_gpu.errors import InventorySpecError
from dask_gpu.inventory import GPUDevice, WorkerInventory, discover, restrict_to_allocation
from dask_gpu.isolation import IsolationError, IsolationSettings, TenantGate, TenantRefused, plan_for
from dask_gpu.slurm.allocation import SlurmAllocation, allocation, gres_type, parse_indexes


def nvml_like(n: int = 4, gpu_type: str = "H100") -> WorkerInventory:
    return WorkerInventory(source="nvml", devices=tuple(
        GPUDevice(index=i, uuid=f"GPU-{i}", name=f"NVIDIA {gpu_type} 80GB HBM3", gpu_type=gpu_type, memory_gb=80.0)
        for i in range(n)))


@pytest.fixture
def no_slurm(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES",
                 "DASK_GPU_SLURM_GPU_TYPE", "SLURM_JOB_USER", "DASK_GPU_DECLARED"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_outside_a_slurm_job_there_is_no_allocation(no_slurm):
    assert allocation() is None
    assert allocation({"SLURM_JOB_GPUS": "0"}) is None  # a GPU list without a job id is not an allocation


def test_the_allocation_is_read_from_slurms_environment():
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "1,3", "CUDA_VISIBLE_DEVICES": "0,1", "SLURM_JOB_USER": "ana",
           "SLURMD_NODENAME": "gpu7", "DASK_GPU_SLURM_GPU_TYPE": "h100"}
    a = allocation(env)
    assert a == SlurmAllocation(job_id="42", gpus=(1, 3), gpu_type="H100", user="ana", node="gpu7")
    # no SLURM_JOB_GPUS: CUDA_VISIBLE_DEVICES; no type asked of Slurm here
    assert allocation({"SLURM_JOB_ID": "5", "CUDA_VISIBLE_DEVICES": "2"}, ask_slurm=False).gpus == (2,)
    # a job with no GPU list at all: None (Slurm did not restrict it)
    assert allocation({"SLURM_JOB_ID": "5"}, ask_slurm=False).gpus is None


def test_index_lists_and_their_errors():
    assert parse_indexes("0,1", "X") == (0, 1)
    assert parse_indexes("0-2,5", "X") == (0, 1, 2, 5)
    assert parse_indexes("", "X") == ()
    with pytest.raises(InventorySpecError, match=r"SLURM_JOB_GPUS='a,b' is not a list of GPU indexes.*Fix:"):
        allocation({"SLURM_JOB_ID": "1", "SLURM_JOB_GPUS": "a,b"}, ask_slurm=False)


def test_the_gres_type_is_read_from_the_jobs_record():
    assert gres_type("gres:gpu:h100:2") == "H100"
    assert gres_type("cpu=1,gres/gpu:a100=4") == "A100"
    assert gres_type("gres:gpu:2") is None  # an untyped GRES names no type
    assert gres_type("") is None


def test_nvml_devices_are_restricted_to_the_allocation_and_typed_by_its_gres():
    inv = restrict_to_allocation(nvml_like(4), SlurmAllocation(job_id="9", gpus=(1, 3), gpu_type="H100-SXM"))
    assert [d.index for d in inv.devices] == [1, 3]
    assert {d.gpu_type for d in inv.devices} == {"H100-SXM"}
    assert inv.slurm_job == "9" and inv.resources()["GPU"] == 2.0
    assert inv.describe() == "2 x H100-SXM 80 GB (Slurm job 9)"


def test_a_declared_inventory_of_the_jobs_size_takes_the_allocations_indexes():
    one = WorkerInventory(source="declared", devices=(GPUDevice(index=0, uuid="GPU-declared-h100-0", name="Declared H100",
                                                                gpu_type="H100", memory_gb=80.0),))
    inv = restrict_to_allocation(one, SlurmAllocation(job_id="3", gpus=(1,)))
    assert [d.index for d in inv.devices] == [1] and inv.slurm_job == "3"


def test_an_allocation_the_inventory_cannot_hold_is_an_error_with_a_fix():
    with pytest.raises(InventorySpecError, match=r"Slurm job 4 was given GPUs 5,6 .* indexes 0,1,2,3\. Fix:"):
        restrict_to_allocation(nvml_like(4), SlurmAllocation(job_id="4", gpus=(5, 6)))


def test_a_job_without_a_gpu_list_keeps_the_inventory():
    inv = restrict_to_allocation(nvml_like(2), SlurmAllocation(job_id="8"))
    assert len(inv.devices) == 2 and inv.slurm_job == "8"


def test_discover_restricts_the_declared_node_to_the_job(no_slurm):
    no_slurm.setenv("DASK_GPU_DECLARED", "2 GPUs, 80 GB, H100")
    assert len(discover().devices) == 2 and discover().slurm_job is None  # outside Slurm: the whole node
    no_slurm.setenv("SLURM_JOB_ID", "17")
    no_slurm.setenv("SLURM_JOB_GPUS", "1")
    no_slurm.setenv("CUDA_VISIBLE_DEVICES", "0")  # renumbered by a cgroup: Slurm's physical index decides
    no_slurm.setenv("DASK_GPU_SLURM_GPU_TYPE", "h100")
    inv = discover()
    assert [d.index for d in inv.devices] == [1] and inv.slurm_job == "17" and inv.gpu_types == {"H100"}


def test_inside_a_slurm_job_auto_serves_one_tenant(no_slurm):
    no_slurm.setenv("SLURM_JOB_ID", "21")
    no_slurm.setenv("SLURM_JOB_USER", "ana")
    with pytest.raises(IsolationError, match=r"Slurm job 21 as ana.*Fix: start it for that tenant"):
        plan_for(IsolationSettings(mode="auto"))
    plan = plan_for(IsolationSettings(mode="auto", tenant="team-a"))
    assert plan.mode == "unisolated"
    assert "Slurm job 21 as ana: Slurm's cgroup confines the job" in plan.describe()
    assert "serves tenant team-a only" in plan.describe()
    gate = TenantGate(plan)
    gate.admit("team-a", "r1")
    with pytest.raises(TenantRefused, match=r"tenant 'team-b' is refused: this worker serves tenant 'team-a' only"):
        gate.admit("team-b", "r2")
    assert plan_for(IsolationSettings(mode="shared")).mode == "shared"  # the operator's explicit choice stands
