"""GPU capacity that follows the queue from zero, on a real one-node Slurm (tests/slurm_cluster.py).

Every group of the scaler starts at 0 jobs and no worker has joined: a run for a GPU type only a group has, and the
runs of a tenant only a group serves, are admitted as waiting for capacity, start on the jobs the scaler submits for
them and complete; four quarter-GPU shards of one tenant submit one job; a run for a group whose partition is down
fails within the group's bound with Slurm's own reason, nothing charged. Skipped, with the reason, where Slurm cannot
start (a failure where AISCHED_REQUIRE_SLURM is set, as in CI).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time

import pytest
from prefect import flow
from prefect.context import FlowRunContext

from aisched_prefect import ai_task
from blocks import BudgetBlock
from dask_gpu.slurm.capacity import capacity_on_scheduler
from tests.helpers import authority, tenant
from tests.slurm_cluster import SlurmCluster, started_or_skip
from tests.test_slurm import SUBMITTED, Scaler, job_env, start_cluster, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.usefixtures("prefect_api"), pytest.mark.timeout(900)]

NODE = "4 GPUs, 80 GB, H100"  # the node's four GRES stand-ins as a worker without NVML is told them; the job's GRES
PRICES = BudgetBlock(limit=100.0, gpu_hour_prices={"H100": 4.0, "A100": 2.5, "A10": 1.0},
                     token_prices_per_1k={"*": 0.01})
DOWN_BOUND = 25.0  # seconds a run waits for the group whose partition is down


def _where() -> dict:
    import os

    from dask_gpu import current_devices

    return {"job": os.environ.get("SLURM_JOB_ID"), "devices": [d.key for d in current_devices()],
            "type": [d.gpu_type for d in current_devices()]}


on_a100 = ai_task(gpus=1, gpu_type="A100", kind="inference", est_seconds=30, name="on_a100")(_where)
on_a10 = ai_task(gpus=1, gpu_type="A10", kind="inference", est_seconds=30, name="on_a10")(_where)


def _quarter(i: int) -> dict:
    import os

    return {"shard": i, "job": os.environ.get("SLURM_JOB_ID")}


quarter = ai_task(gpus=0.25, gpu_type="H100", kind="inference", est_seconds=30, name="quarter")(_quarter)
gang = ai_task(gpus=2, hosts=2, gpu_type="H100", kind="training", est_seconds=30, name="gang")(_where)


def test_runs_only_groups_at_zero_jobs_hold_start_on_the_jobs_submitted_for_them(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING)
    slurm = SlurmCluster(tmp_path / "slurm", gpus=2, gpu_type="h100", more_types=(("a100", 1), ("a10", 1)),
                         down_partition="down")
    started_or_skip(slurm)
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    cluster = start_cluster(tmp_path)
    scaler = None
    try:
        cluster.start_plane()
        config = tmp_path / "slurm-workers.yaml"
        group = {"declared": NODE, "memory": "2GB", "partition": "gpu", "min_jobs": 0}
        config.write_text(json.dumps({
            "scheduler": cluster.address, "tls_dir": str(cluster.tls), "trust_keys": [cluster.key],
            "interval_seconds": 0.5, "python": sys.executable, "log_directory": str(tmp_path / "jobs"),
            "local_directory": str(tmp_path / "scratch"),
            "policy": {"max_jobs": 4, "idle_seconds": 5, "start_seconds": 400, "groups": [
                {**group, "name": "a100-a", "gpu_type": "A100", "gpus": 1, "tenant": "team-a", "max_jobs": 1},
                {**group, "name": "h100-c", "gpu_type": "H100", "gpus": 1, "tenant": "team-c", "max_jobs": 2},
                {**group, "name": "a10-down", "gpu_type": "A10", "gpus": 1, "tenant": "team-a", "max_jobs": 1,
                 "partition": "down",
                 "start_seconds": DOWN_BOUND}]}}))
        scaler = Scaler(config, job_env(cluster, slurm, tmp_path / "scratch"), tmp_path / "scaler.log")
        with cluster.client() as client:
            wait_for("the scaler to publish its groups", lambda: scaler.text() is not None and
                     client.run_on_scheduler(capacity_on_scheduler), timeout=120)
            assert not client.scheduler_info()["workers"]  # from zero: no worker, no job
        assert slurm.jobs() == [] and not scaler.lines(SUBMITTED)

        out: dict[str, object] = {}
        ids: dict[str, str] = {}

        team_a = tenant(cluster.plane, budget_=PRICES)

        @flow(task_runner=team_a.runner())
        def a100_flow():
            ids["a100"] = str(FlowRunContext.get().flow_run.id)
            return on_a100()

        team_c = tenant(cluster.plane, authority_=authority(principal="team-c/nightly"), budget_=PRICES,
                        principal="team-c/nightly")

        @flow(task_runner=team_c.runner())
        def team_c_flow():
            ids["team-c"] = str(FlowRunContext.get().flow_run.id)
            return [f.result() for f in quarter.map(range(4))]

        @flow(task_runner=team_a.runner())
        def a10_flow():
            ids["a10"] = str(FlowRunContext.get().flow_run.id)
            try:
                return on_a10()
            except Exception as exc:  # refused once its bound passed: its message, as the flow sees it
                return exc

        def run(name: str, fn) -> None:
            began = time.monotonic()
            out[name] = fn()
            out[f"{name}-seconds"] = time.monotonic() - began

        threads = [threading.Thread(target=run, args=(n, f), daemon=True)
                   for n, f in (("a100", a100_flow), ("team-c", team_c_flow), ("a10", a10_flow))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        submitted = {m.group(2).rsplit("-", 2)[0]: [] for m in scaler.lines(SUBMITTED)}
        for m in scaler.lines(SUBMITTED):
            submitted[m.group(2).rsplit("-", 2)[0]].append(m.group(1))

        # A GPU type only a group at 0 jobs has: it started on the job the scaler submitted for it, and completed.
        assert isinstance(out["a100"], dict), out
        assert out["a100"]["job"] in submitted["a100-a"] and out["a100"]["type"] == ["A100"], (out, submitted)
        # A tenant only a group at 0 jobs serves, four quarter-GPU shards: one job, all four on it.
        assert len(submitted["h100-c"]) == 1, scaler.text()
        assert sorted(r["shard"] for r in out["team-c"]) == [0, 1, 2, 3], out
        assert {r["job"] for r in out["team-c"]} == set(submitted["h100-c"]), (out, submitted)
        # The group whose partition is down: the run failed within its bound with Slurm's reason, nothing charged.
        refused = out["a10"]
        assert isinstance(refused, Exception) and "PartitionDown" in str(refused), refused
        assert "a10-down" in str(refused), refused
        assert out["a10-seconds"] < DOWN_BOUND + 60, out
        records = cluster.plane.records(ids["a10"])
        settled = [r.payload for r in records if r.kind == "settlement"]
        assert [s["outcome"] for s in settled] == ["no-capacity"] and not any(settled[0].get("charges", {}).values())
        waits = [r.payload["waiting_for"] for r in records if r.kind == "capacity-wait"]
        assert any("a Slurm job of group a10-down was submitted: job" in w and "pending: PartitionDown" in w
                   for w in waits), waits
        assert all(a["pending"] == 0 for a in cluster.plane.ledger().accounts())
        # The flow's log said what each waited for.
        said = [r.getMessage() for r in caplog.records if "waits for capacity" in r.getMessage()]
        assert any("on_a100 waits for capacity: a worker of Slurm group a100-a" in s for s in said), said
        job = submitted["a100-a"][0]
        assert any(f"on_a100 waited for capacity: a Slurm job of group a100-a was submitted: job {job}" in r.getMessage()
                   for r in caplog.records), said  # replayed in the flow's log with the run's own lines
        assert any("on_a10 waited for capacity: a Slurm job of group a10-down was submitted: job" in r.getMessage()
                   and "pending: PartitionDown" in r.getMessage() for r in caplog.records)
        for name in ("a100", "team-c"):
            admitted = [r for r in cluster.plane.records(ids[name]) if r.kind == "settlement"]
            assert admitted and all(r.payload["outcome"] == "completed" for r in admitted), admitted
        # A two-host gang of team-c: its members on two worker jobs held together (one job per member, both of
        # group h100-c: the scaler submits what the idle one lacks), each on its own job's GPU.
        @flow(task_runner=team_c.runner())
        def gang_flow():
            ids["gang"] = str(FlowRunContext.get().flow_run.id)
            return gang()

        began = time.monotonic()
        assert gang_flow()["type"] == ["H100"]
        out["gang-seconds"] = time.monotonic() - began
        placed = next(r.payload["placement"] for r in cluster.plane.records(ids["gang"]) if r.kind == "settlement")
        names = [m["name"] for m in placed["members"]]
        jobs = {m.group(2): m.group(1) for m in scaler.lines(SUBMITTED)}
        assert len(set(names)) == 2 and all(n.startswith("h100-c-") for n in names), placed
        assert len({jobs[n] for n in names}) == 2, (names, jobs)
        print(f"from zero: the A100 run took {out['a100-seconds']:.1f} s, team-c's four shards "
              f"{out['team-c-seconds']:.1f} s, the run for the down partition failed after {out['a10-seconds']:.1f} s, "
              f"the two-host gang {out['gang-seconds']:.1f} s")
    finally:
        if scaler is not None:
            scaler.stop()
            print(scaler.text()[-4000:])
        cluster.close()
        slurm.close()
