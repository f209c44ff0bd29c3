"""A `.map()` is admitted as one request: its elements share one decision, each holds and is recorded on its own.

Stages 0-4 (configuration, feasibility, pricing, authority, approval policy) are taken once for the elements of a
map with the same request over the same snapshot of authority (aisched_prefect/control/admission/decisions.py); each element still takes its own
budget hold, has its own admission record (naming the element whose admission decided it: `decided_with`) and its
own settlement. A revocation makes a new snapshot: no element is admitted on a decision taken before it.
"""

from __future__ import annotations

import uuid

from prefect import flow
from prefect.context import FlowRunContext

from aisched_prefect import ai_task
from tests.helpers import authority, tenant


@ai_task(gpus=0.25, kind="inference", est_seconds=5)
def shard(i):
    return i * 2


def test_a_maps_elements_share_one_decision_and_each_holds_and_settles_on_its_own(control_plane):
    t = tenant(control_plane)

    @flow(task_runner=t.runner())
    def batch():
        return [f.result() for f in shard.map(range(24))], str(FlowRunContext.get().flow_run.id)

    out, run = batch()
    assert out == [i * 2 for i in range(24)]
    records = control_plane.records(run)
    admissions = [r for r in records if r.kind == "admission"]
    settlements = [r for r in records if r.kind == "settlement"]
    assert len(admissions) == 24 and len(settlements) == 24
    elements = {r.task_run_id for r in admissions}
    assert len(elements) == 24  # one admission per element
    holds = [h["id"] for r in admissions for h in r.payload["holds"]]
    assert holds and len(set(holds)) == len(holds)  # each element holds its own budget: no hold is shared
    decided = [r.payload.get("decided_with") for r in admissions]
    assert decided.count(None) >= 1  # some element's admission took the decision
    assert all(d in elements for d in decided if d is not None)  # reused only within its own map
    for r in admissions:  # every element's record says what authorized it, decided or reused
        assert r.payload["chain"] == ["team-a-root"] and r.payload["estimate"]["amount"] > 0


def test_no_element_is_admitted_on_a_decision_taken_before_a_revocation(control_plane):
    root = f"root-{uuid.uuid4().hex[:8]}"  # revocations are global: this test's own root
    t = tenant(control_plane, authority_=authority(id=root))

    @flow(task_runner=t.runner())
    def batch(n: int):
        return [f.result() for f in shard.map(range(n))]

    assert batch(4) == [0, 2, 4, 6]  # a decision for this request is taken (and kept for reuse)
    assert control_plane.revoke(root, "incident").status_code == 200
    state = batch(4, return_state=True)  # at once: within the time a decision is reused
    assert state.is_failed()
    assert f"{root!r} is revoked" in str(state.result(raise_on_failure=False))
