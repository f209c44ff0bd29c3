"""A worker killed mid-task on a cluster of separate processes, under the product's scheduler and under Dask's defaults.

Each scenario starts the cluster as docs/how-to/gpu-cluster.md says (scheduler, two `dask-gpu-worker` hosts with
their nannies, `aisched serve`), runs a 2 x H100 training task, and SIGKILLs the worker process running it: its
nanny restarts it at a new address. Whatever the scheduler's settings, the run ends within seconds (never waits on a
dead address), the death is one `worker-died` record naming the worker and the devices lost, the attempt is settled
once and charged for what can have ran, a re-run Dask does by itself is refused by the ticket, and the flow's
`retries=` decides whether it runs again.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from prefect import flow
from prefect.context import FlowRunContext

from aisched_prefect import ai_task
from tests.clusterprocs import ClusterProcs, kill_worker_process
from tests.helpers import tenant

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api")]  # workers killed: minutes in all

H100 = "2 GPUs, 80 GB, H100"


def _attempt(marker_dir: str) -> int:
    """Run once per body start: write this attempt's worker pid and address, then run 'for a long time' the first time."""
    import psutil

    from dask_gpu import current_devices, current_worker

    starts = sorted(Path(marker_dir).glob("start-*"))
    n = len(starts) + 1
    worker_pid = psutil.Process(os.getppid()).ppid()  # body <- zygote <- worker process
    Path(marker_dir, f"start-{n}").write_text(f"{worker_pid} {current_worker()} "
                                              f"{','.join(d.key for d in current_devices())}")
    if n == 1:
        time.sleep(120)
    return worker_pid


@ai_task(gpus=2, gpu_type="H100", kind="training", est_seconds=600, retries=1, retry_delay_seconds=0)
def train_with_retry(marker_dir: str) -> int:
    return _attempt(marker_dir)


@ai_task(gpus=2, gpu_type="H100", kind="training", est_seconds=600)
def train_once(marker_dir: str) -> int:
    return _attempt(marker_dir)


def kill_first_attempt(marker_dir: Path, killed: dict) -> None:
    deadline = time.time() + 90
    first = marker_dir / "start-1"
    while not first.exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # it has run a second
    pid, address, devices = first.read_text().split()
    killed.update(pid=int(pid), address=address, devices=devices.split(","), at=time.monotonic())
    kill_worker_process(int(pid))


def run_and_kill(cluster: ClusterProcs, task, tmp_path: Path) -> tuple[object, str, dict, float]:
    plane = cluster.plane
    t = tenant(plane)
    marker = tmp_path / "markers"
    marker.mkdir()
    killed: dict = {}
    ids: list[str] = []

    @flow(task_runner=t.runner())
    def nightly():
        ids.append(str(FlowRunContext.get().flow_run.id))
        try:
            return task(str(marker))
        except Exception as exc:  # the run failed: its message, as the flow sees it
            return exc

    killer = threading.Thread(target=kill_first_attempt, args=(marker, killed), daemon=True)
    killer.start()
    out = nightly()
    ended = time.monotonic()
    killer.join(5)
    assert killed, "the first attempt never started"
    return out, ids[0], killed, ended - killed["at"]


def cluster_of(tmp_path: Path, product: bool, queue: bool = True) -> ClusterProcs:
    cluster = ClusterProcs(tmp_path / "cluster", product_scheduler=product, queue=queue)
    try:
        cluster.start_scheduler()
        cluster.start_worker("h100-a", H100)
        cluster.start_worker("h100-b", H100)
        cluster.wait_for_workers(2)
        cluster.start_plane()
    except BaseException:
        cluster.close()
        raise
    return cluster


def check_death_records(plane, flow_run_id: str, killed: dict) -> tuple[list, dict]:
    records = plane.records(flow_run_id)
    died = [r for r in records if r.kind == "worker-died"]
    assert len(died) == 1, [r.kind for r in records]
    d = died[0].payload
    assert d["worker"] == killed["address"] and d["name"] in ("h100-a", "h100-b")
    assert d["devices"] == killed["devices"] == ["0", "1"]
    settlement = next(r for r in records if r.kind == "settlement" and r.seq > died[0].seq)
    s = settlement.payload
    assert s["outcome"] == "worker-died" and d["name"] in s["error"]
    first = s["attempts"][0]
    assert first["outcome"] == "worker-died" and first["worker"] == killed["address"] and first["devices"] == ["0", "1"]
    for later in s["attempts"][1:]:  # a re-run Dask did by itself: refused by the ticket, ran nothing, charged nothing
        assert later["outcome"].startswith("refused") and later["seconds"] == 0
    admission = next(r for r in records if r.kind == "admission")
    charged = s["settlements"][0]["charged"]
    # Charged once, for what can have run (at most the hold; seconds, not the 600 s it reserved).
    assert 0 < charged <= admission.payload["holds"][0]["reserved"]
    assert charged < 0.1 * admission.payload["holds"][0]["reserved"]
    return records, s


def test_worker_killed_mid_task_under_the_products_scheduler_is_recorded_and_retried(tmp_path):
    cluster = cluster_of(tmp_path, product=True)
    try:
        out, flow_run_id, killed, took = run_and_kill(cluster, train_with_retry, tmp_path)
        assert isinstance(out, int) and out != killed["pid"], out  # retries=1: the second attempt completed
        assert took < 30  # no wait on the dead address
        records, s = check_death_records(cluster.plane, flow_run_id, killed)
        assert [r.kind for r in records] == ["admission", "worker-died", "settlement", "admission", "settlement"]
        assert records[-1].payload["outcome"] == "completed"
        starts = sorted((tmp_path / "markers").glob("start-*"))
        assert len(starts) == 2  # the killed attempt and the retry: nothing ran twice
        ledger = cluster.plane.ledger()
        assert all(a["pending"] == 0 for a in ledger.accounts()) and ledger.verify().ok
        # evidence show and explain list each attempt
        from typer.testing import CliRunner

        from aisched_prefect.cli import app

        shown = CliRunner().invoke(app, ["evidence", "show", "--flow-run", flow_run_id, "--ledger", cluster.plane.ledger_url])
        assert shown.exit_code == 0 and "worker-died" in shown.output and "completed" in shown.output
        explained = CliRunner().invoke(app, ["explain", flow_run_id, "--ledger", cluster.plane.ledger_url])
        assert explained.exit_code == 0, explained.output
        assert "WORKER DIED" in explained.output and "attempt 1" in explained.output
    finally:
        cluster.close()


def test_worker_killed_mid_task_under_dasks_defaults_does_not_hang(tmp_path):
    """A plain `dask scheduler` (allowed-failures 3): the task is pinned to the dead address and Dask would leave it
    in no-worker forever; the control plane ends it when the worker leaves, and retries=0 means no second run."""
    cluster = cluster_of(tmp_path, product=False)
    try:
        out, flow_run_id, killed, took = run_and_kill(cluster, train_once, tmp_path)
        from dask_gpu import WorkerDied

        assert isinstance(out, WorkerDied) and str(out).startswith("the worker h100-"), out
        assert "running this task died (devices 0,1 lost); it was charged for at most" in str(out)
        assert took < 30
        records, s = check_death_records(cluster.plane, flow_run_id, killed)
        assert [r.kind for r in records] == ["admission", "worker-died", "settlement"]
        assert len(list((tmp_path / "markers").glob("start-*"))) == 1
        assert all(a["pending"] == 0 for a in cluster.plane.ledger().accounts())
        with cluster.client() as client:
            client.wait_for_workers(2, timeout=60)  # the nanny brought the worker back at a new address
            state = client.sync(client.scheduler.gpu_queue_status)
            assert state["running"] == 0 and state["queued"] == 0  # the queue freed what the dead run held
    finally:
        cluster.close()


def test_dask_rerunning_a_task_by_itself_is_refused_by_its_ticket(tmp_path):
    """Dask's defaults and no queue: the task is not pinned, so Dask re-runs it on the other H100 worker by itself;
    the ticket is single-use cluster-wide, so the body never runs a second time under one admission."""
    cluster = cluster_of(tmp_path, product=False, queue=False)
    try:
        out, flow_run_id, killed, took = run_and_kill(cluster, train_with_retry, tmp_path)
        assert isinstance(out, int) and out != killed["pid"], out  # the flow's retry ran it again, admitted again
        assert took < 30
        records, s = check_death_records(cluster.plane, flow_run_id, killed)
        assert [r.kind for r in records] == ["admission", "worker-died", "settlement", "admission", "settlement"]
        assert len(list((tmp_path / "markers").glob("start-*"))) == 2  # killed attempt + the retry; no third
    finally:
        cluster.close()


def _by_value():
    """Defined in a function: pickled by value, so the body's process need not import this test module."""

    def long_body(marker_dir: str) -> int:
        import os
        import time
        from pathlib import Path

        import psutil

        worker_pid = psutil.Process(os.getppid()).ppid()
        Path(marker_dir, f"start-{os.getpid()}").write_text(str(worker_pid))
        time.sleep(120)
        return worker_pid

    return long_body


_long_body = _by_value()


def test_a_rerun_dask_does_by_itself_is_refused_and_listed_by_the_registry(tmp_path):
    """Below the control plane: Dask's defaults re-run a task whose worker died on the other worker by themselves;
    the ticket registry refuses the second redemption (the body never starts twice) and lists the refused attempt
    next to where the first ran, which is what the control plane's settlement copies into `attempts`."""
    import cloudpickle

    from aisched_prefect.control.service import load_or_make_key
    from dask_gpu import GPURequest
    from dask_gpu.body.code import code_digest
    from dask_gpu.worker.sandbox import Body, run_ticketed
    from dask_gpu.tickets import TicketRejected, TicketSigner, digest, install_registry

    cluster = ClusterProcs(tmp_path / "cluster", product_scheduler=False)
    try:
        cluster.start_scheduler()
        cluster.start_worker("h100-a", H100)
        cluster.start_worker("h100-b", H100)
        cluster.wait_for_workers(2)
        signer = TicketSigner(load_or_make_key(cluster.home / "control.key"))
        marker = tmp_path / "markers"
        marker.mkdir()
        body = Body(payload=cloudpickle.dumps(_long_body) + cloudpickle.dumps(((str(marker),), {})))
        request = GPURequest(gpus=2, gpu_type="H100")
        ticket = signer.issue(run="rerun-test", payload_digest=digest(body.payload), code_digest=code_digest(_long_body),
                              request=request)
        with cluster.client() as client:
            install_registry(client)
            future = client.submit(run_ticketed, ticket, body, key="aisched-rerun-test", resources=request.resources(),
                                   pure=False)  # not pinned: Dask may run it anywhere, and re-run it
            deadline = time.time() + 60
            while not list(marker.glob("start-*")) and time.time() < deadline and not future.done():
                time.sleep(0.05)
            assert not future.done(), future.result()
            (first,) = marker.glob("start-*")
            kill_worker_process(int(first.read_text()))
            with pytest.raises(TicketRejected, match="already used.*refused on"):
                future.result(timeout=60)
            where = client.sync(client.scheduler.gpu_ticket_where, id=ticket.id)
        assert len(list(marker.glob("start-*"))) == 1  # the body started once
        (member,) = where["members"]
        assert list(member["devices"]) == ["0", "1"] and member["name"] in ("h100-a", "h100-b")
        (refused,) = where["refused"]
        assert refused["worker"] != member["worker"] and refused["member"] == 0
    finally:
        cluster.close()


@ai_task(gpus=1, gpu_type="L40S", kind="inference", est_seconds=5)
def on_l40s() -> list[str]:
    from dask_gpu import current_devices

    return [d.gpu_type for d in current_devices()]


def test_feasibility_follows_a_worker_joining(tmp_path):
    """A request no worker can hold is denied at once, naming the GPU type no worker has and what the cluster has;
    once a host that can hold it joins the cluster, the same request runs there."""
    from aisched_prefect import AdmissionDenied
    from tests.helpers import budget

    cluster = ClusterProcs(tmp_path / "cluster")
    try:
        cluster.start_scheduler()
        cluster.start_worker("h100-host", H100)
        cluster.wait_for_workers(1)
        cluster.start_plane()
        t = tenant(cluster.plane, budget_=budget().model_copy(update={"gpu_hour_prices": {"H100": 4.0, "L40S": 2.0}}))

        @flow(task_runner=t.runner())
        def f():
            try:
                on_l40s()
                raise AssertionError("admitted with no L40S in the cluster")
            except AdmissionDenied as exc:
                first = exc.stage, str(exc)
            cluster.start_worker("l40s-host", "1 GPU, 48 GB, L40S")
            cluster.wait_for_workers(2)
            return first, on_l40s()

        (stage, message), types = f()
        assert stage == "feasibility" and "no worker has GPU type 'L40S' (the cluster has: H100 x2)" in message
        assert types == ["L40S"]
    finally:
        cluster.close()
