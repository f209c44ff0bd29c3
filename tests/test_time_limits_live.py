"""Time limits in real flows (issue 42): a control plane of its own with a 1 s grace and a 4 s kill wait stops a run
past its est_seconds, ends it, settles it `time-limit` and charges what ran; a run that checkpoints is requeued and
resumes; a run declared with no limit is not stopped and its tenant's next runs are planned on its overrun."""

from __future__ import annotations

import shutil
import time
import uuid

import pytest
from prefect import flow
from prefect.context import FlowRunContext

from aisched_prefect import ai_task
from blocks import BudgetBlock
from dask_gpu import StopRequested, checkpoint
from tests.controlplane import ControlPlaneProcess
from tests.helpers import authority, tenant

pytestmark = [pytest.mark.usefixtures("prefect_api"), pytest.mark.slow]
PRICES = {"gpu_hour_prices": {"H100": 4.0, "A10": 1.0}, "token_prices_per_1k": {"*": 0.01}}
GRACE, KILL_WAIT = 1.0, 4.0


@pytest.fixture(scope="module")
def limited_plane(tmp_path_factory, plane_home, gpu_cluster):
    home = tmp_path_factory.mktemp("limited-plane")
    shutil.copy(plane_home / "control.key", home / "control.key")
    plane = ControlPlaneProcess(home, dask_address=gpu_cluster.scheduler_address, dask_tls=plane_home / "tls",
                                env={"AISCHED_TIME_LIMIT_GRACE_SECONDS": str(GRACE),
                                     "AISCHED_TIME_LIMIT_KILL_WAIT_SECONDS": str(KILL_WAIT)}).start()
    yield plane
    plane.stop()


def own_tenant(plane):
    principal = f"tl-{uuid.uuid4().hex[:8]}/nightly"
    return tenant(plane, authority_=authority(principal=principal), principal=principal,
                  budget_=BudgetBlock(**PRICES, limit=10))


def settlements(plane, run: str) -> list[dict]:
    return [r.payload for r in plane.records(run) if r.kind == "settlement"]


def test_a_run_past_its_limit_is_asked_to_stop_then_ended_charged_and_recorded_time_limit(limited_plane, tmp_path):
    t = own_tenant(limited_plane)
    marks = tmp_path / "marks"
    marks.touch()

    @ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=2)
    def stubborn(path):
        try:
            for _ in range(6000):
                time.sleep(0.05)
                checkpoint()
        except StopRequested:
            with open(path, "a") as f:
                f.write("asked\n")
        for _ in range(6000):  # it does not stop: it is ended after the kill wait
            time.sleep(0.05)
        return "never"

    runs: list[str] = []

    @flow(task_runner=t.runner())
    def train():
        runs.append(str(FlowRunContext.get().flow_run.id))
        return stubborn(str(marks))

    with pytest.raises(Exception, match="time limit"):
        train()
    assert marks.read_text() == "asked\n"  # its checkpoint() raised first
    (s,) = settlements(limited_plane, runs[0])
    assert s["outcome"] == "time-limit"
    assert 2 + GRACE + KILL_WAIT - 0.5 <= s["seconds"] < 2 + GRACE + KILL_WAIT + 10  # ended after the kill wait
    charged = sum(x["charged"] for x in s["settlements"])
    assert charged == pytest.approx(s["seconds"] / 3600 * 4.0, rel=1e-3)  # charged for what ran
    # its holds never covered time past the limit and the graces
    assert s["covered_seconds"] <= 2 + GRACE + KILL_WAIT + 1e-6


def test_a_checkpointing_run_is_requeued_at_its_limit_and_resumes(limited_plane, tmp_path):
    t = own_tenant(limited_plane)
    state, starts = tmp_path / "step", tmp_path / "starts"
    state.write_text("0")
    starts.touch()

    @ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=2, requeue_on_time_limit=True)
    def resumable(path, log):
        with open(log, "a") as f:
            f.write("start\n")
        step = int(open(path).read())  # its own checkpoint
        while step < 10:  # 10 steps of 0.5 s: more than one limit's worth of work
            time.sleep(0.5)
            step += 1
            with open(path, "w") as f:
                f.write(str(step))
            checkpoint()
        return step

    runs: list[str] = []

    @flow(task_runner=t.runner())
    def train():
        runs.append(str(FlowRunContext.get().flow_run.id))
        return resumable(str(state), str(starts))

    assert train() == 10
    assert starts.read_text().count("start") >= 2  # stopped at its limit, queued again, resumed from step > 0
    outcomes = [s["outcome"] for s in settlements(limited_plane, runs[0])]
    assert outcomes[-1] == "completed" and set(outcomes[:-1]) == {"time-limit"} and len(outcomes) >= 2
    requeued = [r for r in limited_plane.records(runs[0]) if r.kind == "admission" and r.payload.get("requeued")]
    assert requeued and all("time-limit" in r.payload["requeued"] for r in requeued)


def test_a_run_with_no_limit_runs_past_it_and_its_tenants_next_is_planned_on_its_worst_overrun(limited_plane):
    t = own_tenant(limited_plane)

    @ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=1, time_limit=None)
    def unlimited():
        time.sleep(1 + GRACE + KILL_WAIT + 2)  # past where a limited run is ended
        return "done"

    runs: list[str] = []

    @flow(task_runner=t.runner())
    def train():
        runs.append(str(FlowRunContext.get().flow_run.id))
        return unlimited(), unlimited()

    assert train() == ("done", "done")
    plans = [s["placement"]["queue_plan"] for s in settlements(limited_plane, runs[0])]
    assert [s["outcome"] for s in settlements(limited_plane, runs[0])] == ["completed"] * 2  # never stopped
    # no limit: planned as a run of the queue's default time (6 h), as Slurm plans a job without --time
    assert plans[0]["factor"] == 1.0 and plans[0]["planned"] == plans[0]["no_limit_plan"] == 21600.0
    assert plans[1]["factor"] >= 4.0  # its tenant's worst overrun, learned from the first run
    assert plans[1]["planned"] == pytest.approx(max(plans[1]["factor"] * 1, 21600.0))
