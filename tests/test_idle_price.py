"""The idle time a run may leave warm is part of its price (issue 39: money).

Before: a run under `max_cost_per_run 0.10`, priced 0.056 so nobody was asked, left a 0.083 idle hold (5 minutes of
a quarter H100): run and idle together past the cap, and no approval rule ever saw the idle part. Now the keep-warm
time is cut so run and idle fit the grant's max_cost_per_run, and the price an approval rule reads (and a person
sees) is the run plus that idle time.
"""

from __future__ import annotations

import uuid

import pytest

from aisched_prefect import ai_task
from aisched_prefect.request import AIRequest
from blocks import ApprovalPolicyBlock, ApprovalRule, Grant
from tests.approval_helpers import RawCall
from tests.clusterprocs import single_host
from tests.helpers import authority, budget, tenant, wait_until

RUN = 0.25 * 4.0 * 200 / 3600  # a quarter H100 for 200 s at 4.0 an hour: 0.0556
IDLE_RATE = 0.25 * 4.0 / 3600  # its share idle, per second


@ai_task(gpus=0.25, gpu_type="H100", kind="inference", est_seconds=200)  # keeps its body warm 300 s by default
def answer(x: int) -> int:
    return x + 1


def test_the_idle_time_is_cut_so_run_and_idle_fit_the_smallest_cap():
    from aisched_prefect.control.admission.idle_price import idle_price

    req = AIRequest(gpus=0.25, gpu_type="H100", kind="inference", est_seconds=200)
    chain = [Grant(id="root", principal="p", max_cost_per_run=1.0), Grant(id="leaf", principal="p", max_cost_per_run=0.1)]
    got = idle_price(budget().model_copy(), req, ["H100"], RUN, chain, 3600)
    assert got.asked_seconds == 300 and got.capped_by == "leaf"
    assert RUN + got.cost == pytest.approx(0.10) and got.seconds == pytest.approx((0.10 - RUN) / IDLE_RATE)
    roomy = idle_price(budget(), req, ["H100"], RUN, chain[:1], 3600)
    assert roomy.seconds == 300 and roomy.capped_by is None and roomy.cost == pytest.approx(300 * IDLE_RATE)
    assert idle_price(budget(), req, ["H100"], RUN, chain[:1], 60).seconds == 60  # the plane's AISCHED_MAX_KEEP_WARM
    cold = AIRequest(gpus=1, gpu_type="H100", kind="training", est_seconds=200)
    assert idle_price(budget(), cold, ["H100"], 0.2, chain, 3600).cost == 0  # training: no warm body


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, prefect_api):
    """A plane with warm bodies on (the suite's shared planes turn them off: tests/conftest.py)."""
    with single_host(tmp_path_factory.mktemp("idle-price"), env={"AISCHED_MAX_KEEP_WARM_SECONDS": "3600"}) as procs:
        yield procs


def _records(plane, flow_run_id: str, kind: str) -> list:
    return [r for r in plane.records(flow_run_id) if r.kind == kind]


@pytest.mark.usefixtures("prefect_api")
def test_max_cost_per_run_counts_the_idle_hold(cluster):
    control_plane = cluster.plane
    t = tenant(control_plane, authority_=authority(id=f"capped-{uuid.uuid4().hex[:6]}", max_cost_per_run=0.10))
    call = RawCall(t, answer, 1)
    reply, result = call.send()
    assert reply.status == "completed" and result == 2
    hold = wait_until(lambda: _records(control_plane, call.flow_run_id, "warm-hold"), 60, "the idle hold")[0]
    assert RUN + hold.payload["keep_seconds"] * IDLE_RATE <= 0.10 + 1e-9  # run and idle hold within the cap
    admission = _records(control_plane, call.flow_run_id, "admission")[0]
    idle = admission.payload["idle"]
    assert idle["asked_seconds"] == 300 and idle["capped_by"] and idle["seconds"] < 300
    assert admission.payload["estimate"]["amount"] + idle["cost"] <= 0.10 + 1e-9
    assert hold.payload["keep_seconds"] == pytest.approx(idle["seconds"])  # the body waits no longer than priced
    call.close()


@pytest.mark.usefixtures("prefect_api")
def test_an_approval_threshold_counts_the_idle_hold(cluster):
    """0.056 of run is under the rule's 0.08; with the idle time it may leave (0.083) it is not: a person is asked,
    and sees the idle part."""
    control_plane = cluster.plane
    rule = ApprovalRule(name="over-8-cents", min_cost=0.08)
    t = tenant(control_plane, policy=ApprovalPolicyBlock(rules=[rule], timeout_seconds=60))
    call = RawCall(t, answer, 1)
    reply, _ = call.send()
    assert reply.status == "approval-pending" and reply.approval.rule == "over-8-cents"
    view = reply.approval
    assert view.idle_seconds == 300 and view.idle_cost == pytest.approx(300 * IDLE_RATE)
    assert view.est_cost == pytest.approx(RUN + 300 * IDLE_RATE)
    from aisched_prefect.control.approvals.page import _idle

    assert "up to 5 min after the run" in _idle(view.model_dump())
    call.close()


@pytest.mark.usefixtures("prefect_api")
def test_a_maps_later_elements_keep_the_idle_cap(cluster):
    """A map's later elements reuse the first element's decision (control.decisions): its idle cap comes with it."""
    from prefect import flow
    from prefect.context import FlowRunContext

    t = tenant(cluster.plane, authority_=authority(id=f"capped-{uuid.uuid4().hex[:6]}", max_cost_per_run=0.10))

    @flow(task_runner=t.runner(max_workers=6))
    def batch():
        return [f.result() for f in answer.map(range(6))], FlowRunContext.get().flow_run.id

    results, flow_run_id = batch()
    assert results == [x + 1 for x in range(6)]
    settled = wait_until(lambda: [r for r in _records(cluster.plane, str(flow_run_id), "settlement")]
                         if len(_records(cluster.plane, str(flow_run_id), "settlement")) >= 6 else None, 60,
                         "every run's settlement")
    # Each run kept its body warm for at most the capped time (a run straight after another carries the same hold
    # on: control.dispatch.warm `_carry`, only for the same keep-warm time), and every idle hold is within the cap.
    keeps = [s.payload["body"]["keep"] for s in settled]
    assert len(keeps) == 6 and all(0 < k and RUN + k * IDLE_RATE <= 0.10 + 1e-9 for k in keeps), keeps
    holds = _records(cluster.plane, str(flow_run_id), "warm-hold")
    assert holds and all(RUN + h.payload["keep_seconds"] * IDLE_RATE <= 0.10 + 1e-9 for h in holds), \
        [h.payload["keep_seconds"] for h in holds]
