"""The scaling policy that drives Slurm worker jobs from the queue: units (tests/test_slurm.py runs it on real Slurm)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dask_gpu.slurm.scaler import SlurmScalerError, load_settings
from dask_gpu.slurm.scaling import (ScalingPolicy, Waiting, WorkerGroup, WorkerJob, devices_for_fractions, jobs_needed,
                                   plan)

H100_A = WorkerGroup(name="h100-a", gpu_type="h100", gpus=2, tenant="team-a", max_jobs=3)
H100_ANY = WorkerGroup(name="h100-any", gpu_type="H100", gpus=1, max_jobs=2)
A10_B = WorkerGroup(name="a10-b", gpu_type="A10", gpus=1, tenant="team-b", max_jobs=2, min_jobs=1)


def policy(*groups: WorkerGroup, max_jobs: int = 4, idle: float = 30.0) -> ScalingPolicy:
    return ScalingPolicy(groups=groups, max_jobs=max_jobs, idle_seconds=idle)


def run(tenant: str = "team-a", gpus: float = 1, width: int = 0, types: tuple[str, ...] | None = ("H100",)) -> Waiting:
    return Waiting(tenant=tenant, gpus=gpus, width=width, types=types)


def test_runs_are_packed_as_the_queue_counts_them():
    g = H100_A  # two GPUs a job
    assert jobs_needed(g, [run(gpus=1), run(gpus=1), run(gpus=2)]) == 2
    assert jobs_needed(g, [run(gpus=0.25), run(gpus=0.5)]) == 1  # fractions share a device, as the queue shares it
    assert jobs_needed(g, [run(gpus=4, width=2)]) == 2  # a gang over two hosts: two whole jobs
    assert jobs_needed(g, [run(gpus=1)] * 3) == 2


def test_four_quarter_gpu_shards_need_one_gpu_and_so_one_job():
    one_gpu = WorkerGroup(name="h100-1", gpu_type="H100", gpus=1, max_jobs=4)
    shards = [run(gpus=0.25)] * 4
    assert jobs_needed(one_gpu, shards) == 1
    assert plan(policy(one_gpu), shards, []).submit == {"h100-1": 1}
    assert jobs_needed(one_gpu, shards + [run(gpus=0.25)]) == 2  # a fifth quarter opens a second device
    assert jobs_needed(one_gpu, [run(gpus=0.75), run(gpus=0.5), run(gpus=0.25)]) == 2  # first fit decreasing
    assert jobs_needed(H100_A, [run(gpus=0.75), run(gpus=0.5), run(gpus=1)]) == 2  # two devices + one GPU, 2 a job
    assert devices_for_fractions([0.5] * 6) == 3
    # A worker whose shared device still has room: the waiting quarters go there (the queue places them there
    # first), no second job for them while the first shard runs
    busy = [WorkerJob(name="w1", group="h100-1", joined=True, idle=None, room=(0.75,))]
    assert plan(policy(one_gpu), [run(gpus=0.25)] * 3, busy).submit == {"h100-1": 0}
    assert plan(policy(one_gpu), [run(gpus=0.25)] * 4, busy).submit == {"h100-1": 1}


def test_waiting_runs_submit_jobs_per_type_and_tenant_within_the_bounds():
    p = policy(H100_A, A10_B, H100_ANY, max_jobs=4)
    waiting = [run(gpus=2), run(gpus=2), run(gpus=2), run(gpus=2),  # team-a: four 2-GPU runs -> 4 jobs, max 3
               run(tenant="team-b", types=("A10",)),                 # team-b's A10 run
               run(tenant="team-c")]                                  # no team-c group but the any-tenant one
    out = plan(p, waiting, [])
    assert out.backlog == {"h100-a": 4, "a10-b": 1, "h100-any": 1}
    # h100-a is capped by its max_jobs (3); a10-b gets its 1; the operator's max (4) leaves nothing for h100-any
    assert out.submit == {"h100-a": 3, "a10-b": 1, "h100-any": 0}
    assert out.unserved == 0


def test_a_run_no_group_can_hold_submits_nothing():
    out = plan(policy(H100_A), [run(tenant="team-b"), run(gpus=4), run(types=("A100",))], [])
    assert out.submit == {"h100-a": 0} and out.unserved == 3


def test_pending_jobs_and_idle_workers_count_against_the_backlog():
    p = policy(H100_A)
    jobs = [WorkerJob(name="p1", group="h100-a"), WorkerJob(name="w1", group="h100-a", joined=True, idle=1.0)]
    assert plan(p, [run(gpus=2)] * 3, jobs).submit == {"h100-a": 1}
    busy = [WorkerJob(name="w1", group="h100-a", joined=True, idle=None)]
    assert plan(p, [run(gpus=2)], busy).submit == {"h100-a": 1}  # a busy worker holds no waiting run


def test_min_jobs_are_kept_and_idle_workers_beyond_them_given_back():
    p = policy(A10_B, idle=30.0)
    assert plan(p, [], []).submit == {"a10-b": 1}  # min_jobs 1, even with nothing waiting
    jobs = [WorkerJob(name="old", group="a10-b", joined=True, idle=100.0),
            WorkerJob(name="new", group="a10-b", joined=True, idle=40.0)]
    assert plan(p, [], jobs).cancel == ["old"]  # the longest idle one goes; one stays (min_jobs)
    young = [WorkerJob(name="a", group="a10-b", joined=True, idle=5.0), WorkerJob(name="b", group="a10-b",
                                                                                   joined=True, idle=None)]
    assert plan(p, [], young).cancel == []  # not idle long enough, or busy
    pending = [WorkerJob(name="k", group="a10-b", joined=True, idle=None), WorkerJob(name="p", group="a10-b")]
    assert plan(p, [], pending).cancel == ["p"]  # a job still pending that nothing waits for
    assert plan(p, [run(tenant="team-b", types=("A10",))], jobs).cancel == []  # a backlog keeps them all


def test_bad_groups_are_refused_naming_the_field():
    with pytest.raises(ValidationError, match="min_jobs 3 is more than max_jobs 2"):
        WorkerGroup(name="x", gpu_type="H100", min_jobs=3, max_jobs=2)
    with pytest.raises(ValidationError, match="lower-case letters"):
        WorkerGroup(name="H100 A", gpu_type="H100")
    with pytest.raises(ValidationError, match="unique"):
        ScalingPolicy(groups=[H100_A, H100_A])
    assert H100_A.gres_request == "gpu:h100:2"


def test_the_configuration_file_is_checked(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("scheduler: tls://x:1\ntls_dir: /t\ntrust_keys: [k]\npolicy: {groups: [{name: a, gpu_type: H100, "
                   "gpus: 0}]}\n")
    with pytest.raises(SlurmScalerError, match=r"policy\.groups\.0\.gpus: Input should be greater than or equal to 1"
                                               r".*Fix:"):
        load_settings(bad)
    with pytest.raises(SlurmScalerError, match=r"cannot read .*missing\.yaml.*Fix:"):
        load_settings(tmp_path / "missing.yaml")
    good = tmp_path / "good.yaml"
    good.write_text("scheduler: tls://x:1\ntls_dir: /t\ntrust_keys: [k]\npolicy:\n  max_jobs: 2\n  groups:\n"
                    "    - {name: h100, gpu_type: h100, tenant: team-a}\n")
    s = load_settings(good)
    assert s.policy.groups[0].gpu_type == "H100" and s.policy.max_jobs == 2


def test_the_entry_point_says_what_it_needs(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    exe = str(Path(sys.executable).parent / "dask-gpu-slurm")
    shown = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert shown.returncode == 0 and "dask-gpu-slurm CONFIG" in shown.stdout and "idle_seconds" in shown.stdout
    bad = subprocess.run([exe, str(tmp_path / "none.yaml")], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert bad.returncode == 1 and "dask-gpu-slurm: cannot read the scaler configuration" in bad.stderr
    assert "Fix:" in bad.stderr and not list(tmp_path.iterdir())  # nothing started, nothing written


def test_dask_gpu_slurm_help_lists_its_options_and_config_fields_and_check_submits_nothing(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    exe = str(Path(sys.executable).parent / "dask-gpu-slurm")
    done = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for option in ("--check", "--log-level", "CONFIG", "start_seconds", "gpu_memory_gb", "interval_seconds"):
        assert option in done.stdout, done.stdout
    config = tmp_path / "slurm-workers.yaml"
    config.write_text("scheduler: tls://127.0.0.1:1\ntls_dir: /nonexistent\ntrust_keys: [abc]\npolicy:\n"
                      "  start_seconds: 120\n  groups: [{name: a100-1, gpu_type: a100, tenant: team-c}]\n")
    done = subprocess.run([exe, config, "--check"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "a100-1: --gres=gpu:a100:1, team-c, 0-1 jobs" in done.stdout and "at most 120 s" in done.stdout
    config.write_text(config.read_text().replace(", tenant: team-c", ""))  # a group of workers that would not start
    done = subprocess.run([exe, config, "--check"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "group a100-1 names no tenant" in done.stderr and "Fix:" in done.stderr


def test_a_job_whose_worker_left_while_slurm_still_lists_it_is_ended_by_slurm_not_given_back(monkeypatch, caplog):
    """A scancel: the worker leaves at once, Slurm lists the job COMPLETING a while longer. The scaler waits for
    Slurm's word (ended outside the scaler) instead of giving it back as a pending job, and counts it meanwhile."""
    import asyncio
    import logging
    from types import SimpleNamespace

    from dask_gpu.slurm import scaler as module
    from dask_gpu.slurm.jobs import JobEnd

    squeue = {"7": ("RUNNING", "None")}
    monkeypatch.setattr(module, "queue_states", lambda ids: {i: squeue[i] for i in ids if i in squeue})
    monkeypatch.setattr(module, "job_end", lambda job: JobEnd(job=job, state="CANCELLED"))
    workers = {"h100-a-1": {"busy": True, "room": ()}}

    class Client:
        async def run_on_scheduler(self, fn, **kw):
            return {"queue": True, "workers": workers, "waiting": []} if fn is module.backlog_on_scheduler else None

    closed = []
    settings = module.ScalerSettings(scheduler="tls://x:1", tls_dir="/nonexistent", trust_keys=("ab",),
                                     policy=policy(H100_A, idle=1.0))
    scaler = module.SlurmScaler(settings)
    scaler.client = Client()

    async def close():
        closed.append(True)

    scaler.jobs["h100-a-1"] = (H100_A, SimpleNamespace(job_id="7", close=close))
    caplog.set_level(logging.WARNING, "dask_gpu.slurm")
    asyncio.run(scaler.step())  # its worker joined
    workers.clear()
    squeue["7"] = ("COMPLETING", "None")  # scancel: the worker is gone, Slurm still lists the job
    for _ in range(3):
        decision = asyncio.run(scaler.step())
        assert decision.cancel == [] and "h100-a-1" in scaler.jobs and not closed
    del squeue["7"]
    asyncio.run(scaler.step())
    assert "h100-a-1" not in scaler.jobs and not closed
    assert "worker job 7 (h100-a-1) ended outside the scaler: Slurm job 7: CANCELLED" in caplog.text
    assert "gave back" not in caplog.text
