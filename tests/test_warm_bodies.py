"""Warm bodies on a cluster of separate processes: a model loads once per body, not once per shard; a body serves
only its own principal's runs of its own code; it is evicted for another's waiting run, ended when its authority
ends or when it crashed, and its idle time is settled once as `warm-idle`.

The model lives in tests/warm_model.py (module level, behind a lock, and in a callable class), which reaches the
workers as its source. One worker with one H100 holds four quarter-GPU bodies at most.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prefect import flow
from prefect.context import FlowRunContext

from tests.clusterprocs import single_host
from tests.helpers import authority, tenant, wait_until
from tests.warm_model import Scorer, cold_score, score, whole

pytestmark = pytest.mark.usefixtures("prefect_api")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, prefect_api):
    with single_host(tmp_path_factory.mktemp("warm"), env={"AISCHED_MAX_KEEP_WARM_SECONDS": "3600"}) as procs:
        yield procs


def _loads(log: Path) -> list[str]:
    return log.read_text().split("\n")[:-1] if log.exists() else []


def _bodies(records: list) -> list[dict]:
    return [r.payload["body"] for r in records if r.kind == "settlement" and r.payload.get("body")]


def test_a_model_loads_once_per_warm_body_not_once_per_shard(cluster, tmp_path):
    cluster.end_warm_bodies()
    t = tenant(cluster.plane)
    log = tmp_path / "loads"

    @flow(task_runner=t.runner(max_workers=16))
    def batch():
        return [f.result() for f in score.map(range(24), log=str(log))], FlowRunContext.get().flow_run.id

    results, flow_run_id = batch()
    assert [r["score"] for r in results] == [2.0 * i for i in range(24)]
    loads, pids = _loads(log), {r["pid"] for r in results}
    # A quarter GPU on one GPU: four bodies at most, each loading the model once (the module-level lock pickled
    # nothing: the module travelled as source).
    assert 1 <= len(loads) <= 4 and len(loads) == len(set(loads)) and set(map(int, loads)) == pids
    bodies = _bodies(cluster.plane.records(flow_run_id))
    assert len(bodies) == 24
    assert {b["id"] for b in bodies if b["start"] == "cold"} == {b["id"] for b in bodies}
    assert sum(b["start"] == "warm" for b in bodies) == 24 - len({b["id"] for b in bodies})
    assert all(b["kept"] and b["keep"] == 30 for b in bodies)


def test_a_callable_class_is_constructed_once_per_body(cluster, tmp_path):
    cluster.end_warm_bodies()
    t = tenant(cluster.plane)
    log = tmp_path / "calls"

    @flow(task_runner=t.runner(max_workers=16))
    def batch():
        return [f.result() for f in Scorer.map(range(12), log=str(log))]

    results = batch()
    assert sorted(r["shard"] for r in results) == list(range(12))
    constructed = {(r["pid"], r["loaded"]) for r in results}
    assert len(constructed) == len({r["pid"] for r in results}) <= 4


def test_a_body_that_crashed_is_not_reused(cluster, tmp_path):
    cluster.end_warm_bodies()
    t = tenant(cluster.plane)
    log = tmp_path / "loads"

    @flow(task_runner=t.runner())
    def sequence():
        first = score(0, str(log))
        crashed = score.submit(3, str(log), crash_on=3)
        crashed.wait()
        after = score(1, str(log))
        return first, crashed.state, after, FlowRunContext.get().flow_run.id

    first, crashed, after, flow_run_id = sequence()
    assert crashed.is_failed()
    bodies = _bodies(cluster.plane.records(flow_run_id))
    assert [(b["start"], b["kept"]) for b in bodies] == [("cold", True), ("warm", False), ("cold", True)]
    # The crash ran in the first run's warm body; the run after it got a fresh body, which loaded the model again.
    assert bodies[1]["id"] == bodies[0]["id"] != bodies[2]["id"]
    assert after["pid"] != first["pid"] and len(_loads(log)) == 2
    assert bodies[1]["id"] not in {b["id"] for b in cluster.warm_bodies()}


def test_a_warm_body_serves_only_its_principal_and_is_evicted_for_another(cluster, tmp_path):
    """Tenant A's four idle bodies fill the GPU; tenant B's run of the same code, then A's second principal's, start
    bodies of their own (A's are evicted for them, before any running work would be preempted)."""
    cluster.end_warm_bodies()
    a = tenant(cluster.plane)
    b = tenant(cluster.plane, authority_=authority(id="team-b-root", principal="team-b/nightly"),
               principal="team-b/nightly")
    a2 = tenant(cluster.plane, authority_=authority(id="team-a-other", principal="team-a/other"),
                principal="team-a/other")

    across = score.with_options(keep_warm_across_flow_runs=True)  # A's bodies wait past A's flow run

    def run(who, log: Path) -> set[int]:
        @flow(task_runner=who.runner(max_workers=8))
        def batch():
            return [f.result() for f in across.map(range(8), log=str(log))]

        return {r["pid"] for r in batch()}

    a_pids = run(a, tmp_path / "a")
    wait_until(lambda: len(cluster.warm_bodies()) == len(a_pids), 30, "tenant A's bodies to wait warm")
    b_pids = run(b, tmp_path / "b")
    a2_pids = run(a2, tmp_path / "a2")
    assert not a_pids & b_pids and not a_pids & a2_pids and not b_pids & a2_pids
    assert set(map(int, _loads(tmp_path / "b"))) == b_pids  # B loaded its own model in its own bodies
    with cluster.client() as client:
        status = client.sync(client.scheduler.gpu_queue_status)
    assert status["evicted"] >= len(a_pids) and status["preempted"] == 0


def test_revocation_ends_an_idle_warm_body(cluster, tmp_path):
    cluster.end_warm_bodies()
    t = tenant(cluster.plane, authority_=authority(id="revoked-root"))
    log = tmp_path / "loads"

    across = score.with_options(keep_warm_across_flow_runs=True)  # idle after its flow run, until revoked

    @flow(task_runner=t.runner())
    def one():
        return across(1, str(log)), FlowRunContext.get().flow_run.id

    _, flow_run_id = one()
    wait_until(lambda: len(cluster.warm_bodies()) == 1, 30, "the body to wait warm")
    t0 = time.monotonic()
    assert cluster.plane.revoke("revoked-root", reason="incident").json() == {"revoked": True}
    wait_until(lambda: not cluster.warm_bodies(), 30, "the revoked principal's warm body to end")
    ended_after = time.monotonic() - t0
    idle = wait_until(lambda: [r for r in cluster.plane.records(flow_run_id) if r.kind == "warm-idle"], 30,
                      "its idle time to be settled")
    assert len(idle) == 1 and idle[0].payload["ended"] == "its authority ended: grant 'revoked-root' is revoked"
    print(f"idle warm body ended {ended_after:.2f}s after the revocation")


def test_warm_idle_is_held_and_settled_once_per_idle_period(cluster, tmp_path):
    cluster.end_warm_bodies()
    t = tenant(cluster.plane)
    log = tmp_path / "loads"
    short = score.with_options(keep_warm=1.0)

    @flow(task_runner=t.runner(max_workers=8))
    def batch():
        return [f.result() for f in short.map(range(8), log=str(log))], FlowRunContext.get().flow_run.id

    _, flow_run_id = batch()
    wait_until(lambda: not cluster.warm_bodies(), 30, "the bodies' keep-warm time to pass")

    def settled() -> list:
        records = cluster.plane.records(flow_run_id)
        holds = [r for r in records if r.kind == "warm-hold"]
        idle = [r for r in records if r.kind == "warm-idle"]
        return (holds, idle) if holds and len(idle) == len(holds) else []

    holds, idle = wait_until(settled, 30, "every idle period to be settled")
    kept = [b for b in _bodies(cluster.plane.records(flow_run_id)) if b["kept"]]
    # A run that took a body and left it warm again carries its idle period on under the same hold (one record
    # settles a stretch of waits, each listed): every kept run's wait is in exactly one settlement.
    assert len(kept) == 8 and 1 <= len(holds) <= 8
    assert sum(r.payload.get("periods", 1) for r in idle) == len(kept)
    assert sum(len(r.payload.get("waits", ())) for r in idle) == len(kept) - len(holds)
    assert all(0 <= r.payload["seconds"] <= 1.0 for r in idle)
    periods = [r.task_run_id for r in idle]
    assert len(periods) == len(set(periods)) == len(holds)
    # `aisched report` shows the idle time as its own kind, beside the runs (the CLI reads the ledger the same way).
    from typer.testing import CliRunner

    from aisched_prefect.cli import app
    from aisched_prefect.reports.usage import usage_rows

    rows = usage_rows(cluster.plane.ledger(), flow_run_id=str(flow_run_id))
    warm_rows = [r for r in rows if r.kind == "warm-idle"]
    assert len(warm_rows) == len(idle) and len([r for r in rows if r.kind == "batch-inference"]) == 8
    assert sum(r.periods for r in warm_rows) == 8  # the report counts every wait, however many records settle them
    assert all(r.money >= 0 and r.seconds is not None and r.seconds <= 1.0 for r in warm_rows)
    out = CliRunner().invoke(app, ["report", "--ledger", cluster.plane.ledger_url, "--by", "kind"],
                             env={"COLUMNS": "200"})
    assert out.exit_code == 0 and "warm-idle" in out.output, out.output


def test_a_body_with_keep_warm_zero_ends_after_its_run(cluster, tmp_path):
    cluster.end_warm_bodies()
    t = tenant(cluster.plane)
    log = tmp_path / "loads"

    @flow(task_runner=t.runner(max_workers=4))
    def batch():
        return [f.result() for f in cold_score.map(range(4), log=str(log))]

    results = batch()
    assert len({r["pid"] for r in results}) == 4 and len(_loads(log)) == 4
    assert not cluster.warm_bodies()


def test_a_whole_gpu_run_evicts_idle_shared_bodies_of_another_key(cluster, tmp_path):
    """A's quarter-GPU bodies, warm for 10 minutes, fill the GPU; B's one-GPU run ends them (they are idle) and runs:
    it does not wait out their keep-warm time."""
    cluster.end_warm_bodies()
    a = tenant(cluster.plane)
    b = tenant(cluster.plane, authority_=authority(id="team-b-root", principal="team-b/nightly"),
               principal="team-b/nightly")
    long_warm = score.with_options(keep_warm=600, keep_warm_across_flow_runs=True)

    @flow(task_runner=a.runner(max_workers=8))
    def fill():
        return {f.result()["pid"] for f in long_warm.map(range(8), log=str(tmp_path / "a"))}

    a_pids = fill()
    wait_until(lambda: len(cluster.warm_bodies()) == len(a_pids) == 4, 30, "A's four bodies to fill the GPU, warm")
    with cluster.client() as client:
        before = client.sync(client.scheduler.gpu_queue_status)["evicted"]

    @flow(task_runner=b.runner())
    def one():
        return whole(1)

    assert one() not in a_pids
    with cluster.client() as client:
        assert client.sync(client.scheduler.gpu_queue_status)["evicted"] - before == 4
