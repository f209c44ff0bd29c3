"""GPU workers in real Slurm jobs (tests/slurm_cluster.py: munged, slurmctld, slurmd on 127.0.0.1, two GRES stand-ins).

The scheduler and the control plane run as docs/how-to/gpu-cluster.md starts them (tests/clusterprocs.py); the workers
run inside Slurm batch jobs, started by `sbatch` directly or by `dask-gpu-slurm` from the queue's backlog. Skipped,
with the reason, where Slurm cannot start (not installed, not root); .ci/run installs it and sets
AISCHED_REQUIRE_SLURM, which turns that skip into a failure.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prefect import flow
from prefect.context import FlowRunContext

from aisched_prefect import ai_task
from tests.clusterprocs import BIN, REPO, ClusterProcs
from tests.helpers import authority, tenant
from tests.slurm_cluster import SlurmCluster, started_or_skip
from tests.slurm_walkthrough import (  # noqa: F401 - collected here (that file is no test_*.py)
    test_the_page_marks_its_slurm_walk_through,
    test_the_slurm_walk_through_runs_as_written,
)

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.usefixtures("prefect_api"), pytest.mark.timeout(900)]

NODE = "2 GPUs, 80 GB, H100"  # the node's GPUs, as a worker without NVML is told them; Slurm's GRES picks from them


@pytest.fixture
def slurm(tmp_path, monkeypatch):
    cluster = SlurmCluster(tmp_path / "slurm", gpus=2, gpu_type="h100")
    started_or_skip(cluster)
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))  # the control plane asks Slurm how a worker's job ended
    yield cluster
    cluster.close()


def job_env(cluster: ClusterProcs, slurm: SlurmCluster, scratch: Path) -> dict[str, str]:
    """What a worker job inherits from whoever submits it (sbatch exports the submitter's environment): the
    suite's `shared` isolation removed, so a worker in a job decides as it would on a real cluster."""
    env = {k: v for k, v in slurm.env().items() if not k.startswith(("DASK_DASK_GPU__ISOLATION", "PYTEST_"))}
    env.update(PYTHONPATH=str(REPO), PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
               DASK_TEMPORARY_DIRECTORY=str(scratch), AISCHED_MAX_KEEP_WARM_SECONDS="0")
    return env


def start_cluster(tmp_path: Path) -> ClusterProcs:
    (tmp_path / "scratch").mkdir(exist_ok=True)  # Dask's temporary-directory: the test's own, not the host's /tmp one
    cluster = ClusterProcs(tmp_path / "cluster", env={"DASK_TEMPORARY_DIRECTORY": str(tmp_path / "scratch")})
    try:
        cluster.start_scheduler()
    except BaseException:
        cluster.close()
        raise
    return cluster


def inventories(cluster: ClusterProcs) -> dict[str, dict]:
    with cluster.client() as client:
        found = client.sync(client.scheduler.broadcast, msg={"op": "gpu_inventory"})
    return {a["name"]: a for a in found.values() if isinstance(a, dict)}


def wait_for(what: str, check, timeout: float = 90, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)


def team_b(plane):
    return tenant(plane, authority_=authority(principal="team-b/nightly"), principal="team-b/nightly")


def test_a_worker_in_a_slurm_job_advertises_its_allocation_and_serves_one_tenant(tmp_path, slurm):
    cluster = start_cluster(tmp_path)
    try:
        cluster.start_plane()
        holder = slurm.sbatch(["--gres=gpu:h100:1", "-o", str(tmp_path / "holder.out"), "--wrap", "sleep 600"])
        slurm.wait_job(holder, ("RUNNING",))  # it holds GPU 0: the worker's job gets GPU 1
        log = tmp_path / "worker.out"
        worker = slurm.run(["sbatch", "--parsable", "--gres=gpu:h100:1", "-J", "dask-gpu", "-o", str(log), "--wrap",
                            f"exec {BIN}/dask-gpu-worker {cluster.address} --tls-dir {cluster.tls} --trust-key "
                            f"{cluster.key} --declared '{NODE}' --tenant team-a --name slurm-worker "
                            f"--nthreads 2 --no-dashboard"], env=job_env(cluster, slurm, tmp_path / "scratch")).stdout.strip()
        slurm.wait_job(worker, ("RUNNING",))
        wait_for("the worker in the Slurm job to join", lambda: "slurm-worker" in inventories(cluster))
        inv = inventories(cluster)["slurm-worker"]
        assert [d["index"] for d in inv["inventory"]["devices"]] == [1], inv  # SLURM_JOB_GPUS=1, not the node's two
        assert inv["inventory"]["slurm_job"] == worker and inv["inventory"]["devices"][0]["gpu_type"] == "H100"
        assert inv["isolation"] == "unisolated" and f"Slurm job {worker} as root" in inv["isolation_detail"], inv
        assert "serves tenant team-a only" in inv["isolation_detail"]
        assert f"(Slurm job {worker})" in log.read_text()  # its start line names the job

        @ai_task(gpus=1, gpu_type="H100", kind="inference", est_seconds=30)
        def where() -> dict:
            import os

            from dask_gpu import current_devices

            return {"devices": [d.key for d in current_devices()], "job": os.environ.get("SLURM_JOB_ID"),
                    "uid": os.getuid()}

        ids: list[str] = []

        @flow(task_runner=tenant(cluster.plane).runner())
        def team_a_flow():
            ids.append(str(FlowRunContext.get().flow_run.id))
            return where()

        out = team_a_flow()
        assert out == {"devices": ["1"], "job": worker, "uid": os.getuid()}, out  # as the job's user (root here)
        settled = [r.payload for r in cluster.plane.records(ids[0]) if r.kind == "settlement"]
        assert settled[0]["placement"]["slurm_job"] == worker and settled[0]["placement"]["name"] == "slurm-worker"

        @flow(task_runner=team_b(cluster.plane).runner())
        def team_b_flow():
            try:
                return where()
            except Exception as exc:  # refused: its message, as the flow sees it
                return exc

        # Never sent to the worker that would refuse it (tests/attacks/test_unisolated_tenant.py shows that worker's
        # own refusal): the worker advertises its one tenant, and admission says no worker serves team-b.
        refused = team_b_flow()
        assert isinstance(refused, Exception) and "no worker serves tenant 'team-b'" in str(refused), refused
        assert "--tenant team-b" in str(refused)
    finally:
        cluster.close()


def _bodies():
    """Defined in a function: pickled by value, so a body's process need not import this module."""

    def hold(marker_dir: str, name: str) -> dict:
        """Write where it runs, then wait until the test releases it (a file), at most two minutes."""
        import os
        import time
        from pathlib import Path

        from dask_gpu import current_worker_name

        d = Path(marker_dir)
        n = len(list(d.glob(f"{name}-start-*"))) + 1
        (d / f"{name}-start-{n}").write_text(json.dumps({"job": os.environ.get("SLURM_JOB_ID"),
                                                         "worker": current_worker_name()}))
        deadline = time.time() + 120
        while not (d / "release").exists() and time.time() < deadline:
            time.sleep(0.1)
        return {"job": os.environ.get("SLURM_JOB_ID"), "attempt": n}

    return hold


_hold = _bodies()
hold_task = ai_task(gpus=1, gpu_type="H100", kind="inference", est_seconds=300)(_hold)
hold_with_retry = ai_task(gpus=1, gpu_type="H100", kind="inference", est_seconds=300, retries=1,
                          retry_delay_seconds=0)(_hold)


class Scaler:
    """`dask-gpu-slurm CONFIG` as a process of its own; its log lines as they come."""

    def __init__(self, config: Path, env: dict[str, str], log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen([str(BIN / "dask-gpu-slurm"), str(config)], env=env, stdout=open(log, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        if self.proc.poll() is not None and self.proc.returncode not in (0, -signal.SIGTERM):
            raise AssertionError(f"dask-gpu-slurm exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
        return self.log.read_text()

    def lines(self, pattern: str) -> list[re.Match]:
        return list(re.finditer(pattern, self.text()))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


SUBMITTED = r"submitted Slurm job (\d+) \(([\w-]+),"


def test_worker_jobs_follow_the_queue_and_a_cancelled_job_is_a_dead_worker(tmp_path, slurm):
    cluster = start_cluster(tmp_path)
    scaler = None
    try:
        cluster.start_plane()
        config = tmp_path / "slurm-workers.yaml"
        config.write_text(json.dumps({
            "scheduler": cluster.address, "tls_dir": str(cluster.tls), "trust_keys": [cluster.key],
            "interval_seconds": 0.5, "python": sys.executable, "log_directory": str(tmp_path / "jobs"),
            "local_directory": str(tmp_path / "scratch"),
            "policy": {"max_jobs": 2, "idle_seconds": 4, "groups": [
                {"name": "h100-a", "gpu_type": "H100", "gpus": 1, "tenant": "team-a", "min_jobs": 1, "max_jobs": 2,
                 "partition": "gpu", "declared": NODE, "memory": "2GB"}]}}))
        scaler = Scaler(config, job_env(cluster, slurm, tmp_path / "scratch"), tmp_path / "scaler.log")
        # min_jobs: one worker job at start
        wait_for("the first worker job's worker to join",
                 lambda: scaler.text() is not None and [n for n in inventories(cluster) if n.startswith("h100-a-")],
                 timeout=120)
        assert len(scaler.lines(SUBMITTED)) == 1, scaler.text()

        # Two runs, room for one: the second waits, a worker job is submitted for it, and it starts there.
        marker = tmp_path / "markers"
        marker.mkdir()
        ids: list[str] = []
        t = tenant(cluster.plane)

        @flow(task_runner=t.runner())
        def two_at_once():
            ids.append(str(FlowRunContext.get().flow_run.id))
            futures = [hold_task.submit(str(marker), "first"), hold_task.submit(str(marker), "second")]
            return [f.result() for f in futures]

        out: list = []
        runner = threading.Thread(target=lambda: out.append(two_at_once()), daemon=True)
        entered = time.monotonic()
        runner.start()
        wait_for("one run to start", lambda: list(marker.glob("*-start-1")), timeout=120)
        wait_for("a second worker job", lambda: len(scaler.lines(SUBMITTED)) == 2, timeout=60)
        submitted_after = time.monotonic() - entered
        wait_for("both runs to start", lambda: len(list(marker.glob("*-start-1"))) == 2, timeout=120)
        (marker / "release").write_text("")
        runner.join(120)
        jobs = [m.group(1) for m in scaler.lines(SUBMITTED)]
        starts = {f.name: f.read_text() for f in marker.iterdir()}
        assert sorted(r["job"] for r in out[0]) == sorted(jobs), (out, jobs, starts)  # one run on each worker job
        settled = [r.payload for r in cluster.plane.records(ids[0]) if r.kind == "settlement"]
        assert sorted(s["placement"]["slurm_job"] for s in settled) == sorted(jobs)
        print(f"second worker job submitted {submitted_after:.1f} s after the runs were entered")

        # Nothing waits: the idle worker beyond min_jobs is given back to Slurm.
        gave = wait_for("an idle worker job given back", lambda: scaler.lines(r"gave back Slurm job (\d+)"), timeout=60)
        wait_for("Slurm to list one worker job", lambda: len(slurm.jobs()) == 1, timeout=60)
        left = slurm.jobs()[0]
        assert gave[0].group(1) != left and left in jobs

        # scancel under a run: it ends as a dead worker (recorded with Slurm's reason), charged once, and its retry
        # runs elsewhere (on a job the scaler submits for it: the other worker is busy).
        (marker / "release").unlink()
        ids.clear()

        @flow(task_runner=t.runner())
        def doomed_and_anchor():
            ids.append(str(FlowRunContext.get().flow_run.id))
            futures = [hold_with_retry.submit(str(marker), "doomed"), hold_task.submit(str(marker), "anchor")]
            results = []
            for f in futures:
                try:
                    results.append(f.result())
                except Exception as exc:
                    results.append(exc)
            return results

        out.clear()
        runner = threading.Thread(target=lambda: out.append(doomed_and_anchor()), daemon=True)
        runner.start()
        first = wait_for("the doomed run to start", lambda: list(marker.glob("doomed-start-1")), timeout=120)[0]
        wait_for("the anchor run to start", lambda: list(marker.glob("anchor-start-1")), timeout=120)
        doomed_job = json.loads(first.read_text())["job"]
        slurm.run(["scancel", doomed_job])
        retry = wait_for("the retry to start", lambda: list(marker.glob("doomed-start-2")), timeout=180)[0]
        retry_job = json.loads(retry.read_text())["job"]
        (marker / "release").write_text("")
        runner.join(120)
        assert retry_job != doomed_job
        assert [r["attempt"] if isinstance(r, dict) else r for r in out[0]] == [2, 1], out
        records = cluster.plane.records(ids[0])
        died = [r for r in records if r.kind == "worker-died"]
        assert len(died) == 1, [r.kind for r in records]
        assert died[0].payload["slurm"]["job"] == doomed_job and died[0].payload["slurm"]["state"] == "CANCELLED"
        doomed_run = died[0].task_run_id
        settled = [r.payload for r in records if r.kind == "settlement" and r.task_run_id == doomed_run]
        assert [s["outcome"] for s in settled] == ["worker-died", "completed"], settled
        assert f"Slurm job {doomed_job}: CANCELLED" in settled[0]["error"]
        assert settled[1]["placement"]["slurm_job"] == retry_job
        admission = next(r for r in records if r.kind == "admission" and r.task_run_id == doomed_run)
        assert 0 < sum(settled[0]["charges"].values()) <= admission.payload["holds"][0]["reserved"]
        assert all(a["pending"] == 0 for a in cluster.plane.ledger().accounts())
        assert scaler.lines(rf"worker job {doomed_job} \([\w-]+\) ended outside the scaler: Slurm job {doomed_job}: "
                            r"CANCELLED"), scaler.text()
    finally:
        if scaler is not None:
            scaler.stop()
            print(scaler.text()[-4000:])
        cluster.close()
    assert "giving back" in scaler.text() and "stopped" in scaler.text()
    wait_for("every worker job given back", lambda: slurm.jobs() == [], timeout=60)
