"""The estimate the GPU queue planned a run on travels with the run's settlement evidence, and `aisched explain`
prints it: the declared estimate x the tenant's overrun factor (learned from its history) = the planned one."""

from __future__ import annotations

import time
import uuid

import pytest
from prefect import flow
from prefect.context import FlowRunContext

from aisched_prefect import ai_task
from aisched_prefect.reports.runs import explain
from tests.helpers import authority, tenant

pytestmark = pytest.mark.usefixtures("prefect_api")


def test_explain_shows_the_factor_the_queue_planned_a_run_on(control_plane):
    @ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=1)
    def overruns(i):
        time.sleep(2.5)  # 2.5x what it declared (topped up, not stopped)
        return i

    # a tenant of its own: the queue learns each tenant's overruns, and the shared plane's other tests run as the
    # helpers' default tenant (their runs overran by 2 % on a loaded host, which this test's first run then saw)
    principal = f"est-{uuid.uuid4().hex[:8]}/nightly"
    t = tenant(control_plane, authority_=authority(principal=principal), principal=principal)

    @flow(task_runner=t.runner())
    def twice():
        first = overruns(0)
        return first, overruns(1), str(FlowRunContext.get().flow_run.id)

    *_, run = twice()
    records = control_plane.records(run)
    plans = [r.payload["placement"]["queue_plan"] for r in records if r.kind == "settlement"]
    assert len(plans) == 2
    assert plans[0] == {"declared": 1.0, "factor": 1.0, "planned": 1.0}  # the tenant's first run: as declared
    assert plans[1]["declared"] == 1.0 and plans[1]["factor"] >= 2.0  # it learned the first run's overrun
    assert plans[1]["planned"] == pytest.approx(plans[1]["factor"])
    text = explain(records)
    assert "queue: estimate 1 s planned as declared" in text
    assert f"queue: estimate 1 s x {plans[1]['factor']:.3g} (tenant history) = {plans[1]['planned']:.0f} s planned" in text


def test_the_plan_line_reads_as_its_examples_say():
    import doctest

    import aisched_prefect.reports.runs

    assert doctest.testmod(aisched_prefect.reports.runs).failed == 0
