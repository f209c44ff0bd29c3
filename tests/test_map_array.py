"""A `.map()` of an AI task is one job array: decided once, asked once, each shard still its own run.

The flow marks the shards of one `.map()` as one array (`CallMeta.array`); the control plane takes the array's
decision once (configuration, feasibility, pricing, authority, the approval rule: control/admission/decisions.py), and where
the policy asks a person the first shard's request is the whole map's. Each shard still holds its own budget (the
first as it is admitted, the others as the queue starts them), and is admitted, settled and recorded on its own. A shard the budget cannot cover is refused by name; a revocation
stops the array's running shard and admits none of its waiting ones.
"""

from __future__ import annotations

import os
import re
import threading
import time
import uuid
from pathlib import Path

import pytest
from prefect import flow, task
from prefect.context import FlowRunContext

from aisched_prefect import ai_task
from blocks import ApprovalPolicyBlock, ApprovalRule
from tests.approval_helpers import Gated, accounts_of, outcome, page_answer
from tests.helpers import authority, budget, tenant, wait_until

pytestmark = pytest.mark.usefixtures("prefect_api")


@ai_task(gpus=0.25, kind="inference", est_seconds=5)
def shard(i):
    return i * 2


@ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=30)
def tune(lr: float = 0.1):
    return f"tuned at {lr}"


@ai_task(gpus=1, gpu_type="A10", kind="inference", est_seconds=360)
def held(i: int, flag: str) -> int:
    """Runs until `flag` exists: its hold stays taken, and the cluster's one A10 keeps the others queued."""
    deadline = time.time() + 120
    while not os.path.exists(flag) and time.time() < deadline:
        time.sleep(0.05)
    return i


def test_a_map_is_decided_once_and_each_shard_is_admitted_settled_and_recorded(control_plane):
    t = tenant(control_plane)

    @flow(task_runner=t.runner())
    def batch():
        return [f.result() for f in shard.map(range(16))], str(FlowRunContext.get().flow_run.id)

    out, run = batch()
    assert out == [i * 2 for i in range(16)]
    records = control_plane.records(run)
    admissions = [r for r in records if r.kind == "admission"]
    settlements = [r for r in records if r.kind == "settlement"]
    assert len({r.task_run_id for r in admissions}) == 16 == len(admissions)
    assert {r.task_run_id for r in settlements} == {r.task_run_id for r in admissions} and len(settlements) == 16
    decided = [r.payload.get("decided_with") for r in admissions]
    assert decided.count(None) == 1, decided  # one decision for the whole map, however its shards raced
    (first,) = [r.task_run_id for r in admissions if r.payload.get("decided_with") is None]
    assert set(decided) - {None} == {first}
    # Each shard still holds its own budget: the first as it is admitted, the others as the queue starts them
    # (a `shard-hold` record naming its admission), so the map never holds more than what runs at once.
    later = {str(r.seq): r for r in admissions if r.payload.get("decided_with") is not None}
    assert all(r.payload["holds"] == [] and r.payload["hold"] == "at its start" for r in later.values())
    started = [r for r in records if r.kind == "shard-hold"]
    assert sorted(r.payload["admission"] for r in started) == sorted(later)
    assert all(r.task_run_id == later[r.payload["admission"]].task_run_id for r in started)
    holds = [h["id"] for r in [*admissions, *started] for h in r.payload["holds"]]
    assert len(set(holds)) == 16 == len(holds)
    by_hold = {s["hold_id"] for r in settlements for s in r.payload["settlements"]}
    assert by_hold == set(holds)  # and each shard's own settlement settles the hold it took


def test_a_map_asks_a_person_once_for_all_its_shards(control_plane):
    policy = ApprovalPolicyBlock(rules=[ApprovalRule(name="tuning-needs-a-person", kinds=["training"])],
                                 timeout_seconds=120)
    t = tenant(control_plane, policy=policy)
    g = Gated(t, lambda: [outcome(f.result) for f in tune.map([0.1, 0.2, 0.3, 0.4])])
    (view,) = g.waiting(1)
    g.paused()
    time.sleep(1.0)  # the other shards have reached the plane by now: none of them asked on its own
    others = [v for v in control_plane.ok("GET", "/v1/approvals") if v["flow_run_id"] == g.flow_run_id
              and v["id"] != view.id]
    assert others == []
    assert view.parameters["map"].startswith("4 shards, one approval for all")
    alice = control_plane.approver("alice", t.authority)
    assert "Recorded: alice approved" in page_answer(control_plane, view.id, alice)
    assert g.outcome() == ["tuned at 0.1", "tuned at 0.2", "tuned at 0.3", "tuned at 0.4"]
    records = g.records()
    kinds = [r.kind for r in records]
    assert kinds.count("approval-requested") == 1 and kinds.count("approval") == 1
    admissions = [r for r in records if r.kind == "admission"]
    settlements = [r for r in records if r.kind == "settlement"]
    assert len({r.task_run_id for r in admissions}) == 4 and len({r.task_run_id for r in settlements}) == 4
    shared = [r for r in admissions if r.payload.get("map_approval") == view.id]
    assert len(shared) == 3 and all("alice" in r.payload["approval"] for r in shared)
    assert g.pauses() == 1


@ai_task(gpus=1, gpu_type="A10", kind="inference", est_seconds=360)
def spends(i: int) -> int:
    """Reports what it spent (0.1) on top of its GPU time: a shard's real cost, not its estimate."""
    from aisched_prefect import report_usage

    report_usage(tokens=1, cost=0.1)
    return i


def test_a_map_larger_than_its_budget_runs_the_shards_that_fit_and_refuses_the_rest_by_name(control_plane):
    # A shard's estimate is 0.1 (one A10 hour at 1.0 for 360 s) and it spends 0.1 and a little GPU time. The
    # cluster's one A10 runs one shard at a time; each later shard holds as it starts, so a limit of 0.35 covers
    # three shards' spending, and the fourth finds 0.1 no longer free.
    t = tenant(control_plane, budget_=budget(limit=0.35))

    @flow(task_runner=t.runner())
    def batch():
        futures = spends.map(range(6))
        for f in futures:
            f.wait()
        return [f.state for f in futures], str(FlowRunContext.get().flow_run.id)

    states, run = batch()
    done = [i for i, s in enumerate(states) if s.is_completed()]
    refused = [i for i, s in enumerate(states) if not s.is_completed()]
    assert len(done) == 3 and len(refused) == 3, states
    assert [states[i].result() for i in done] == done
    records = control_plane.records(run)
    denials = [r for r in records if r.kind == "denial"]
    assert sorted(r.payload["shard_index"] for r in denials) == refused
    names = {r.payload["shard_index"]: r.payload["shard"] for r in denials}
    for i in refused:  # each refused shard named by its task run's name (as Prefect shows it) and its index
        said = str(states[i].result(raise_on_failure=False))
        assert re.fullmatch(r"spends-[0-9a-f]+", names[i]) and f"shard {names[i]!r} (#{i} of 6) of the map: budget" in said, said
    assert all(r.payload["stage"] == "budget" for r in denials)
    settled = {r.task_run_id: r.payload["outcome"] for r in records if r.kind == "settlement"}
    assert sorted(settled.values()) == ["completed"] * 3 + ["refused-at-start"] * 3  # each shard ends once
    (account,) = accounts_of(control_plane, t)
    assert account["pending"] == 0 and 0.3 < account["posted"] <= 0.35, account


def test_a_map_whose_budget_cannot_cover_one_shard_is_refused_at_admission_every_shard(control_plane):
    """The array's decider holds as it is admitted, and the shards after it defer only behind a decider that held:
    a map whose budget has no room for one shard's estimate (0.1) never reaches the queue."""
    t = tenant(control_plane, budget_=budget(limit=0.05))

    @flow(task_runner=t.runner())
    def batch():
        futures = spends.map(range(4))
        for f in futures:
            f.wait()
        return [f.state for f in futures], str(FlowRunContext.get().flow_run.id)

    states, run = batch()
    assert not any(s.is_completed() for s in states)
    for s in states:
        assert "of the map: budget" in str(s.result(raise_on_failure=False))
    kinds = [r.kind for r in control_plane.records(run)]
    assert kinds == ["denial"] * 4, kinds  # nothing admitted, queued, held or settled


def _started(batch, got: dict) -> threading.Thread:
    """Run the flow `batch` on a thread of its own; its return value lands in got["out"]."""
    runner = threading.Thread(target=lambda: got.setdefault("out", batch()))
    runner.start()
    return runner


def _one_running_four_queued(control_plane) -> None:
    """Wait until the cluster's one A10 runs one shard of a five-shard map of `held` and four wait in the queue."""
    queue = lambda: control_plane.ok("GET", "/v1/queue")  # noqa: E731
    wait_until(lambda: queue()["running"] >= 1 and queue()["queued"] >= 4, 120,
               what="one shard running on the A10, four queued")


def test_a_maps_waiting_shards_hold_nothing_until_the_queue_starts_them(control_plane, tmp_path):
    """A map holds what runs at once (the cluster's one A10: one shard), not its whole estimate."""
    t = tenant(control_plane, budget_=budget(limit=0.35))  # five shards' estimates (0.5) would not fit at once
    flag = str(tmp_path / "go")
    got: dict = {}

    @flow(task_runner=t.runner())
    def batch():
        got["run"] = str(FlowRunContext.get().flow_run.id)
        return [f.result() for f in held.map(range(5), flag=flag)]

    runner = _started(batch, got)
    try:
        _one_running_four_queued(control_plane)
        (account,) = accounts_of(control_plane, t)
        # The running shard's hold, and the first shard's (held as it was admitted, wherever it waits): not five.
        assert account["pending"] in (pytest.approx(0.1), pytest.approx(0.2)), account
    finally:
        Path(flag).touch()
        runner.join(timeout=300)
    assert got["out"] == [0, 1, 2, 3, 4]
    kinds = [r.kind for r in control_plane.records(got["run"])]
    assert kinds.count("admission") == 5 and kinds.count("shard-hold") == 4 and kinds.count("settlement") == 5


def test_a_revocation_stops_the_running_shard_within_a_second_and_admits_none_of_the_waiting(control_plane, tmp_path):
    root = f"root-{uuid.uuid4().hex[:8]}"  # revocations are global: this test's own root
    t = tenant(control_plane, authority_=authority(id=root))
    flag = str(tmp_path / "never")
    got: dict = {}

    @flow(task_runner=t.runner())
    def batch():
        futures = held.map(range(5), flag=flag)
        for f in futures:
            f.wait()
        return [f.state for f in futures], str(FlowRunContext.get().flow_run.id)

    runner = _started(batch, got)
    try:
        _one_running_four_queued(control_plane)
        revoked_at = time.time()
        assert control_plane.revoke(root, "incident").status_code == 200
        runner.join(timeout=120)
    finally:
        Path(flag).touch()
        runner.join(timeout=120)
    states, run = got["out"]
    assert not any(s.is_completed() for s in states)
    records = control_plane.records(run)
    settlements = [r for r in records if r.kind == "settlement"]
    ran = [r for r in settlements if r.payload.get("outcome") not in ("revoked-while-queued", "revoked-while-waiting")]
    assert len(ran) == 1, [r.payload.get("outcome") for r in settlements]
    assert ran[0].ts - revoked_at <= 1.0, ran[0].ts - revoked_at  # the running shard ended within a second
    for s in states:
        assert "revoked" in str(s.result(raise_on_failure=False))


def test_a_rejected_map_denies_every_shard_and_releases_every_hold(control_plane):
    from tests.approval_helpers import api_answer

    policy = ApprovalPolicyBlock(rules=[ApprovalRule(name="tuning-needs-a-person", kinds=["training"])],
                                 timeout_seconds=120)
    t = tenant(control_plane, policy=policy)
    g = Gated(t, lambda: [outcome(f.result) for f in tune.map([0.1, 0.2, 0.3])])
    (view,) = g.waiting(1)
    resp = api_answer(control_plane, view.id, control_plane.approver("bob", t.authority), approve=False,
                      reason="looked at it")
    assert resp.status_code == 200, resp.text
    out = g.outcome()
    assert len(out) == 3 and all("bob rejected the run: looked at it" in o for o in out), out
    (account,) = accounts_of(control_plane, t)
    assert account["pending"] == 0 and account["posted"] == 0
    assert [r.kind for r in g.records()].count("admission") == 0


@task
def later(i: int) -> int:
    time.sleep(3.0 * i)  # the shards that wait on it reach the plane seconds apart
    return i


def test_a_maps_shards_that_reach_the_plane_seconds_apart_still_share_one_decision(control_plane):
    """Calls that are not one map share a decision for 2 s; the shards of one map share it for the array's life."""
    t = tenant(control_plane)

    @flow(task_runner=t.runner())
    def batch():
        return [f.result() for f in shard.map([later.submit(i) for i in range(3)])], str(FlowRunContext.get().flow_run.id)

    out, run = batch()
    assert out == [0, 2, 4]
    admissions = sorted((r for r in control_plane.records(run) if r.kind == "admission"), key=lambda r: r.ts)
    assert admissions[-1].ts - admissions[0].ts > 2.5  # they did arrive seconds apart
    decided = [r.payload.get("decided_with") for r in admissions]
    assert decided.count(None) == 1, decided
