"""A run the cluster's queue placed goes straight to its worker (`gpu_run` on the control plane's connection to it),
not as a Dask task, on a cluster of separate processes set up as docs/how-to/gpu-cluster.md says.

What must hold for it as for a Dask task's run: the outcome, settlement and records are the same; the scheduler holds
no task of it; its body is stopped when the control plane goes away; only the control plane's certificate may hand a
run over, and a message that is not a ticket and a body is refused before anything runs.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import psutil
import pytest
from prefect import flow
from prefect.context import FlowRunContext

from aisched_prefect import ai_task
from tests.clusterprocs import single_host
from tests.helpers import tenant, wait_until

pytestmark = pytest.mark.usefixtures("prefect_api")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, prefect_api):
    with single_host(tmp_path_factory.mktemp("handover")) as procs:
        yield procs


@ai_task(gpus=1, gpu_type="H100", kind="inference", est_seconds=60)
def waits_for(flag: str, marker: str) -> int:
    Path(marker).write_text(str(os.getpid()))
    while not Path(flag).exists():
        time.sleep(0.02)
    return 7


def _by_value():
    """Defined in a function: pickled by value, so the worker and the scheduler need not import this test module."""

    def callers(dask_worker) -> list[str]:
        return sorted(dask_worker.plugins["dask-gpu"].handover.callers)

    def tasks(dask_scheduler) -> list[str]:
        return sorted(map(str, dask_scheduler.tasks))

    return callers, tasks


_worker_callers, _scheduler_tasks = _by_value()


def _start(cluster, tmp_path: Path) -> tuple[dict, threading.Thread, Path, Path]:
    t = tenant(cluster.plane)
    flag, marker, got = tmp_path / "go", tmp_path / "pid", {}

    @flow(task_runner=t.runner())
    def one():
        got["run"] = str(FlowRunContext.get().flow_run.id)
        return waits_for.submit(str(flag), str(marker)).result(raise_on_failure=False)

    runner = threading.Thread(target=lambda: got.setdefault("out", one()), daemon=True)
    runner.start()
    wait_until(marker.exists, 120, "the body started")
    return got, runner, flag, marker


def test_a_placed_run_goes_straight_to_its_worker_and_settles_as_a_tasks_would(cluster, tmp_path):
    got, runner, flag, _ = _start(cluster, tmp_path)
    with cluster.client() as client:
        try:
            (callers,) = client.run(_worker_callers).values()
            assert len(callers) == 1  # the run waits on the worker under its key, handed over
            assert client.run_on_scheduler(_scheduler_tasks) == []  # and the scheduler holds no task of it
        finally:
            flag.touch()
            runner.join(120)
        assert got["out"] == 7
        assert list(client.run(_worker_callers).values()) == [[]]
    records = cluster.plane.records(got["run"])
    assert [r.kind for r in records] == ["admission", "settlement"]
    s = records[1].payload
    assert s["outcome"] == "completed" and s["placement"]["devices"] == ["0"] and s["placement"]["name"] == "gpu-host"
    assert s["placement"]["worker"].startswith("tls://127.0.0.1:") and s["seconds"] > 0
    assert cluster.plane.ledger().verify().ok


def test_the_plane_going_away_stops_a_handed_over_body(cluster, tmp_path):
    """SIGKILL of the control plane hangs up its connections: the worker stops the body the plane waited on (what
    Dask's cancellation of a gone client's task did), and the plane started again on its address ends the run."""
    got, runner, flag, marker = _start(cluster, tmp_path)
    body = psutil.Process(int(marker.read_text()))
    plane = cluster.plane
    port = plane.url.rsplit(":", 1)[1]
    plane.kill()
    try:
        body.wait(timeout=15)  # stopped by its worker, not left running for nobody
        with cluster.client() as client:
            wait_until(lambda: list(client.run(_worker_callers).values()) == [[]], 15, "the worker to let the run go")
    finally:
        plane.args[plane.args.index("--port") + 1] = port
        plane.start()
        flag.touch()
        runner.join(300)
    assert not runner.is_alive(), "the flow still waits after the plane came back"
    kinds = [r.kind for r in plane.records(got["run"])]
    assert kinds.count("settlement") == kinds.count("admission") >= 1, kinds  # each attempt settled once
    assert plane.ledger().verify().ok


def test_only_the_control_plane_hands_a_run_over_and_only_a_ticket_and_a_body(cluster):
    from distributed.protocol.serialize import to_serialize
    from distributed.utils import sync

    with cluster.client() as client:
        (address,) = client.scheduler_info()["workers"]

        async def send(cert: str, **msg):
            from distributed import rpc

            from dask_gpu.security import ClusterTLS

            role = {"cluster": "worker", "client": "client"}[cert]
            args = ClusterTLS(cluster.tls).security(cert).get_connection_args(role)
            async with rpc(address, connection_args=args) as r:
                return await r.gpu_run(**msg)

        # A worker's certificate (a worker, or a body that read one) may not hand a run over.
        with pytest.raises(PermissionError, match="refuses .gpu_run. from a peer presenting"):
            sync(client.loop, send, "cluster", ticket=None, body=None, key="x")
        # The plane's certificate with something that is not a ticket: refused by type, nothing run.
        from dask_gpu.tickets import TicketRejected

        with pytest.raises(TicketRejected, match="ticket must be a Ticket.*Fix"):
            sync(client.loop, send, "client", ticket=to_serialize({"id": "forged"}), body=None, key="x")
        assert list(client.run(_worker_callers).values()) == [[]]

