"""Preemption in the cluster's queue (runner queue=True): a tenant that arrives takes its quota back from
another tenant's preemptible runs, which are stopped, charged for what ran, and queued again."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from prefect import flow

from aisched_prefect import InvalidAIRequest, Ledger, ai_task
from dask_gpu import checkpoint, install_queue
from tests.helpers import authority, runner

pytestmark = pytest.mark.usefixtures("prefect_api")

STEPS = 40


@ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=30, preemptible=True)
def borrow(i: int, progress: str) -> int:
    """A resumable job: its progress survives a stop in a file; returns the step it (last) started from."""
    path = Path(progress) / f"{i}.step"
    start = int(path.read_text()) if path.exists() else 0
    for step in range(start, STEPS):
        checkpoint()
        time.sleep(0.1)
        path.write_text(str(step + 1))
    return start


@ai_task(gpus=2, gpu_type="H100", kind="training", est_seconds=5)
def urgent() -> float:
    time.sleep(0.5)
    return time.time()


@pytest.fixture
def own_cluster():
    """A cluster of its own: the queue's quotas count the tenants seen lately, and other tests add theirs."""
    from distributed import Client

    from dask_gpu import LocalGPUCluster

    with LocalGPUCluster(declared="2 workers x 2 GPUs, 80 GB, H100") as cluster, \
            Client(cluster, set_as_default=False) as client:
        yield cluster, client


def test_a_tenant_takes_its_quota_back_from_preemptible_runs(own_cluster, sqlite_url, tmp_path):
    cluster, client = own_cluster
    auth = authority(principal="*")
    results: dict[str, object] = {}

    @flow(name="preempt-a", task_runner=runner(cluster.scheduler_address, sqlite_url, principal="a/jobs",
                                               authority=auth, queue=True, max_workers=8))
    def tenant_a() -> list[int]:
        return [f.result() for f in borrow.map(range(4), progress=str(tmp_path))]

    @flow(name="preempt-b", task_runner=runner(cluster.scheduler_address, sqlite_url, principal="b/jobs",
                                               authority=auth, queue=True))
    def tenant_b() -> float:
        return urgent()

    install_queue(client)  # (what each flow run does) so this test can read the queue from the start
    a = threading.Thread(target=lambda: results.update(a=tenant_a()))
    a.start()
    deadline = time.time() + 60
    while client.sync(client.scheduler.gpu_queue_status)["running"] < 3:  # a alone: three start, one GPU is
        assert time.time() < deadline and a.is_alive(), f"tenant a's runs never started: {results}"  # kept free
        time.sleep(0.1)
    results["b"] = tenant_b()
    a.join(timeout=120)

    records = Ledger(sqlite_url).records()
    settled = [r for r in records if r.kind == "settlement"]
    preempted = [r for r in settled if r.payload["outcome"] == "stopped-preempted"]
    # b needs 2 GPUs, a holds 3 of 4 (above its quota of 2 now that b is here): one of a's runs gives one back
    assert len(preempted) == 1 and preempted[0].payload["preempted_for"] == "b"
    starts = sorted(results["a"])
    assert starts[:3] == [0, 0, 0] and 0 < starts[3] < STEPS  # the stopped run went on from its own checkpoint
    assert all(r.payload["task"] == "borrow" and r.payload["tenant"] == "a" for r in preempted)
    for r in preempted:  # charged for what ran: its seconds at the H100 price, not its hold, not nothing
        assert 0 < r.payload["seconds"] < STEPS * 0.1
        assert list(r.payload["charges"].values()) == [pytest.approx(4.0 * r.payload["seconds"] / 3600)]
    b_done = next(r.seq for r in settled if r.payload["task"] == "urgent")
    assert all(r.seq < b_done for r in preempted)  # stopped for b, before b ran to its end
    resumed = {r.task_run_id for r in preempted}
    finals = [r for r in settled if r.task_run_id in resumed and r.payload["outcome"] == "completed"]
    assert len(finals) == 1 and all(r.seq > b_done for r in finals)  # queued again behind b, then completed
    requeued = [r for r in records if r.kind == "admission" and r.payload.get("requeued")]
    assert {r.task_run_id for r in requeued} == resumed  # each admitted again (authority, budget), new hold
    assert all(a["pending"] == 0 for a in Ledger(sqlite_url).accounts())  # every hold, first and requeued, settled
    after = client.sync(client.scheduler.gpu_queue_status)
    assert after["queued"] == 0 and after["running"] == 0


def test_preemptible_needs_whole_gpus():
    with pytest.raises(InvalidAIRequest, match="preemptible"):
        ai_task(gpus=0.5, kind="inference", est_seconds=5, preemptible=True)
