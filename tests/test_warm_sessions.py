"""A warm body ends when nothing of its principal waits any more: its flow process stopped polling (its session's
lease passed) and no other flow process of that principal polls; its idle time is settled up to then, not for the
whole keep-warm time."""

from __future__ import annotations

import pytest
from prefect import flow
from prefect.context import FlowRunContext

from tests.clusterprocs import single_host
from tests.helpers import tenant, wait_until
from tests.warm_model import score

pytestmark = pytest.mark.usefixtures("prefect_api")
LEASE = 3.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, prefect_api):
    with single_host(tmp_path_factory.mktemp("warm-sessions"), env={
        "AISCHED_MAX_KEEP_WARM_SECONDS": "3600", "AISCHED_SESSION_LEASE_SECONDS": str(LEASE)}) as procs:
        yield procs


def test_warm_bodies_end_once_their_principals_flows_are_gone(cluster, tmp_path):
    t = tenant(cluster.plane)
    long_warm = score.with_options(keep_warm=3600, keep_warm_across_flow_runs=True)

    @flow(task_runner=t.runner(max_workers=4))
    def batch():
        return [f.result() for f in long_warm.map(range(4), log=str(tmp_path / "l"))], FlowRunContext.get().flow_run.id

    _, flow_run_id = batch()  # its session polls no more once the flow run ended
    wait_until(lambda: not cluster.warm_bodies(), 60, "the bodies to end once the flow's session lease passed")

    def settled() -> list:
        idle = [r for r in cluster.plane.records(flow_run_id) if r.kind == "warm-idle"]
        holds = [r for r in cluster.plane.records(flow_run_id) if r.kind == "warm-hold"]
        return idle if idle and len(idle) == len(holds) else []

    idle = wait_until(settled, 30, "their idle time to be settled")
    last = [r for r in idle if r.payload["ended"] == "nothing of its principal waits any more"]
    assert last and all(r.payload["seconds"] < 60 for r in idle)  # settled for minutes, not the keep-warm hour
