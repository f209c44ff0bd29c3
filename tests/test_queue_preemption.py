"""Preemption in the cluster's one queue, through the control plane: a tenant that arrives takes its quota back from
another tenant's preemptible runs, which are stopped, charged for what ran, admitted again and queued again.

On a cluster of its own (separate processes): the queue's quotas count the tenants that run or wait now.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from prefect import flow
from prefect.context import FlowRunContext

from aisched_prefect import InvalidAIRequest, ai_task
from dask_gpu import checkpoint
from tests.clusterprocs import ClusterProcs
from tests.helpers import authority, tenant

pytestmark = pytest.mark.usefixtures("prefect_api")

STEPS = 1200  # 0.1 s each: far longer than the test needs; the test ends them (`done`) once b has run
EST = 300


@ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=EST, preemptible=True)
def borrow(i: int, progress: str) -> int:
    """A resumable job: its progress survives a stop in a file; returns the step it (last) started from. It runs
    until the test says `done` (so b arrives while it runs, however slowly a loaded host starts b's flow)."""
    path = Path(progress) / f"{i}.step"
    start = int(path.read_text()) if path.exists() else 0
    for step in range(start, STEPS):
        if (Path(progress) / "done").exists():
            break
        checkpoint()
        time.sleep(0.1)
        tmp = path.with_suffix(".tmp")  # written whole, then renamed: a stop mid-write leaves the last step
        tmp.write_text(str(step + 1))
        tmp.replace(path)
    return start


@ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=5)
def urgent() -> float:
    time.sleep(0.5)
    return time.time()


@pytest.fixture
def own_cluster(tmp_path):
    procs = ClusterProcs(tmp_path / "cluster")
    try:
        procs.start_scheduler()
        procs.start_worker("h100-a", "2 GPUs, 80 GB, H100")
        procs.start_worker("h100-b", "2 GPUs, 80 GB, H100")
        procs.wait_for_workers(2)
        procs.start_plane()
        yield procs
    finally:
        procs.close()


@pytest.mark.parametrize("bodies_begun", [True, False], ids=["after-the-bodies-began", "as-soon-as-placed"])
def test_a_tenant_takes_its_quota_back_from_preemptible_runs(own_cluster, tmp_path, bodies_begun):
    """b arrives once a's four bodies run, or as soon as the queue placed them: then the run stopped may not have
    begun (the worker's stop came first); it is voided instead of charged, and queued again all the same."""
    cluster = own_cluster
    plane = cluster.plane
    a = tenant(plane, authority_=authority(principal="a/jobs"), principal="a/jobs")
    b = tenant(plane, authority_=authority(principal="b/jobs"), principal="b/jobs")
    results: dict[str, object] = {}
    progress = tmp_path / "progress"
    progress.mkdir()

    @flow(name="preempt-a", task_runner=a.runner(max_workers=8))
    def tenant_a() -> tuple[list[int], str]:
        return [f.result() for f in borrow.map(range(4), progress=str(progress))], str(FlowRunContext.get().flow_run.id)

    @flow(name="preempt-b", task_runner=b.runner())
    def tenant_b() -> tuple[float, str]:
        return urgent(), str(FlowRunContext.get().flow_run.id)

    with cluster.client() as client:
        def status() -> dict:
            return client.sync(client.scheduler.gpu_queue_status)

        first = threading.Thread(target=lambda: results.update(a=tenant_a()))
        first.start()
        deadline = time.time() + 90
        while status()["running"] < 4:  # a alone: all four of its runs start, no GPU is kept idle
            assert time.time() < deadline and first.is_alive(), f"tenant a's runs never all started: {status()}"
            time.sleep(0.1)
        assert all(free == 0 for free in status()["free"].values())
        while bodies_begun and len(list(progress.glob("*.step"))) < 4:  # every body has begun
            assert time.time() < deadline and first.is_alive(), "tenant a's bodies never all began"
            time.sleep(0.05)
        try:
            results["b"] = tenant_b()
        finally:
            (progress / "done").write_text("b has run")
        first.join(timeout=120)
        after = status()
    assert after["queued"] == 0 and after["running"] == 0 and after["preempted"] == 1

    a_starts, a_run = results["a"]
    _, b_run = results["b"]
    a_records, b_records = plane.records(a_run), plane.records(b_run)
    settled = [r for r in a_records if r.kind == "settlement"]
    preempted = [r for r in settled if r.payload["outcome"] == "stopped-preempted"]
    # b needs 1 GPU, a holds all 4 (above its quota of 2 now that b waits): exactly one of a's runs gives one back
    assert len(preempted) == 1 and preempted[0].payload["preempted_for"] == "b"
    assert preempted[0].payload["task"] == "borrow" and preempted[0].payload["tenant"] == "a"
    starts = sorted(a_starts)
    r = preempted[0]
    if bodies_begun or r.payload["seconds"] > 0:
        assert starts[:3] == [0, 0, 0] and 0 < starts[3] < STEPS  # the stopped run went on from its own checkpoint
        # charged for what ran: its seconds at the H100 price, not its hold (est_seconds=EST), not nothing; it ran
        # at least the steps it had finished when it was stopped
        assert starts[3] * 0.1 <= r.payload["seconds"] < EST
        assert list(r.payload["charges"].values()) == [pytest.approx(4.0 * r.payload["seconds"] / 3600)]
    else:  # stopped before its body began: nothing ran, nothing is charged
        assert starts == [0, 0, 0, 0] and r.payload["stopped"] == "preempted before it started"
        assert all(x["status"] == "voided" for x in r.payload["settlements"])
    (b_admitted,) = [x for x in b_records if x.kind == "admission"]
    (b_done,) = [x for x in b_records if x.kind == "settlement"]
    # stopped for b, once b was admitted (which of the two is recorded settled first is a race: b may run its 0.5 s
    # on the GPU a's run gave back before a's stop is settled)
    assert b_done.payload["outcome"] == "completed" and b_admitted.seq < r.seq
    finals = [x for x in settled if x.task_run_id == r.task_run_id and x.payload["outcome"] == "completed"]
    # queued again, then completed once: before or after b ends depends on when a's other runs free their GPUs
    assert len(finals) == 1 and finals[0].seq > r.seq
    requeued = [x for x in a_records if x.kind == "admission" and x.payload.get("requeued")]
    assert [x.task_run_id for x in requeued] == [r.task_run_id]  # admitted again (authority, budget), a new hold
    ledger = plane.ledger()
    assert all(h["status"] != "pending" for h in ledger.history(a.budget, limit=100))  # every hold settled
    assert all(h["status"] != "pending" for h in ledger.history(b.budget, limit=100))


def test_preemptible_needs_whole_gpus():
    with pytest.raises(InvalidAIRequest, match="preemptible"):
        ai_task(gpus=0.5, kind="inference", est_seconds=5, preemptible=True)
