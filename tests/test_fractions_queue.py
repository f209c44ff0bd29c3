"""Fractions through the one queue, on a cluster of separate processes: they start on idle devices of an eligible type
while a whole-GPU task holds another host, and a worker's thread count never caps how many share its devices.
The same cluster shows `aisched workers` with a task running, and that workers log nothing per poll."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from prefect import flow
from prefect.context import FlowRunContext
from typer.testing import CliRunner

from aisched_prefect import ai_task
from aisched_prefect.cli import app
from tests.clusterprocs import ClusterProcs
from tests.helpers import tenant

pytestmark = pytest.mark.usefixtures("prefect_api")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, prefect_api):
    procs = ClusterProcs(tmp_path_factory.mktemp("fractions"))
    try:
        procs.start_scheduler()
        procs.start_worker("h100-host", "2 GPUs, 80 GB, H100", nthreads=2)
        procs.start_worker("a10-host", "3 GPUs, 24 GB, A10", nthreads=1)  # one thread: fractions must not queue on it
        procs.wait_for_workers(2)
        procs.start_plane()
        yield procs
    finally:
        procs.close()


def _where() -> dict:
    from dask_gpu import current_devices

    import os

    return {"worker": os.environ["DASK_GPU_WORKER"], "devices": [d.key for d in current_devices()],
            "types": [d.gpu_type for d in current_devices()]}


def _await_files(folder: Path, count: int, seconds: float) -> None:
    """Wait until `count` files lie in `folder`, for at most `seconds`: an event, with a deadline if it never comes."""
    deadline = time.time() + seconds
    while len(list(folder.iterdir())) < count and time.time() < deadline:
        time.sleep(0.05)


@ai_task(gpus=2, gpu_type="H100", kind="training", est_seconds=60)
def train(marker: str, seconds: float, started: str | None = None) -> dict:
    """Holds the H100 host for `seconds`, or, given `started`, until six fractions have started (60 s at most)."""
    Path(marker).write_text("running")
    start = time.time()
    if started is None:
        time.sleep(seconds)
    else:
        _await_files(Path(started), 6, 60.0)
    return {**_where(), "start": start, "end": time.time()}


@ai_task(gpus=0.25, kind="inference", est_seconds=30)
def quarter(i: int, started: str) -> dict:
    """Marks its start, then runs until all six have started (60 s at most): six at once, or the later ones late."""
    start = time.time()
    (Path(started) / str(i)).write_text("started")
    _await_files(Path(started), 6, 60.0)
    time.sleep(0.2)
    return {**_where(), "start": start, "end": time.time()}


def test_fractions_start_on_idle_devices_while_training_holds_another_host(cluster, tmp_path):
    t = tenant(cluster.plane)
    marker = tmp_path / "training-started"
    started = tmp_path / "fractions-started"
    started.mkdir()

    @flow(task_runner=t.runner(max_workers=16))
    def mixed():
        # The training task holds the H100 host until the six fractions have started, or for 60 s if they wait.
        training = train.submit(str(marker), 0.0, str(started))
        deadline = time.time() + 60
        while not marker.exists() and time.time() < deadline:
            time.sleep(0.05)
        quarters = quarter.map(range(6), started=str(started))
        return training.result(), [q.result() for q in quarters], FlowRunContext.get().flow_run.id

    training, quarters, flow_run_id = mixed()
    assert training["types"] == ["H100", "H100"]
    # Every fraction started on an A10 while the training task still ran: none waited behind the busy H100 host.
    assert all(q["types"] == ["A10"] for q in quarters)
    assert all(q["start"] < training["end"] for q in quarters)
    # All six ran at once on a worker with one thread: two devices (four quarters each at most; the queue's
    # policy keeps one GPU of the cluster free for a tenant that runs nothing yet, its headroom).
    assert max(q["start"] for q in quarters) < min(q["end"] for q in quarters)
    per_device: dict[str, int] = {}
    for q in quarters:
        per_device[q["devices"][0]] = per_device.get(q["devices"][0], 0) + 1
    assert sorted(per_device.values()) in ([2, 4], [3, 3]) and max(per_device.values()) <= 4
    records = cluster.plane.records(flow_run_id)
    settled = [r.payload for r in records if r.kind == "settlement"]
    assert len(settled) == 7 and all(s["outcome"] == "completed" for s in settled)
    # A fraction is charged at the type it got: 0.25 GPU x its seconds x the A10 price (1.0 per GPU-hour).
    for s in settled:
        if s["placement"]["gpu_type"] == "A10":
            assert s["settlements"][0]["charged"] == pytest.approx(0.25 * s["seconds"] / 3600 * 1.0, abs=1e-6)
    with cluster.client() as client:
        state = client.sync(client.scheduler.gpu_queue_status)
    assert state["running"] == 0 and state["queued"] == 0 and state["fractions"] == 0
    assert all(v == 0 for devices in state["devices"].values() for v in devices.values())


def test_aisched_workers_shows_what_each_device_holds_while_a_task_runs(cluster, tmp_path):
    t = tenant(cluster.plane)
    marker = tmp_path / "training-started"
    looked = tmp_path / "looked"  # the task runs until both views were taken (not for a time a busy host outlasts)
    looked.mkdir()
    seen: dict = {}

    def look() -> None:
        try:
            deadline = time.time() + 60
            while not marker.exists() and time.time() < deadline:
                time.sleep(0.05)
            args = ["--control-plane", cluster.plane.url, "--token-file", str(cluster.home / "operator.token")]
            seen["json"] = CliRunner().invoke(app, ["workers", "--json", *args])
            seen["table"] = CliRunner().invoke(app, ["workers", *args], env={"COLUMNS": "250"})
        finally:
            for i in range(6):  # what train waits for (at most 60 s)
                (looked / str(i)).write_text("looked")

    @flow(task_runner=t.runner())
    def nightly():
        return train(str(marker), 0.0, str(looked))

    looker = threading.Thread(target=look)
    looker.start()
    nightly()
    looker.join()
    assert seen["json"].exit_code == 0, seen["json"].output
    view = json.loads(seen["json"].output)
    workers = {w["name"]: w for w in view["workers"]}
    assert sorted(workers) == ["a10-host", "h100-host"]
    h100 = workers["h100-host"]
    (run,) = h100["runs"].values()
    assert run["task"] == "train" and run["principal"] == t.principal and sorted(run["devices"]) == ["0", "1"]
    assert h100["free"] == {"0": 0.0, "1": 0.0} and workers["a10-host"]["free"] == {"0": 1.0, "1": 1.0, "2": 1.0}
    table = seen["table"].output
    assert seen["table"].exit_code == 0 and "h100-host" in table and f"train ({t.principal})" in table


def test_workers_log_what_they_advertise_once_and_nothing_per_poll(cluster):
    """After the tests above (tasks polled for minutes' worth of watcher rounds), each worker's log has its
    advertisement once and no line that repeats per poll."""
    for name, advert in (("h100-host", "2 x H100 80 GB"), ("a10-host", "3 x A10 24 GB")):
        log = cluster.log(name)
        lines = [line.split(" - ", 1)[-1] for line in log.splitlines() if " - " in line]
        assert sum(f"GPU worker {name}" in line and advert in line for line in lines) == 1, log[-3000:]
        assert "out-of-band" not in log
        repeated = {line: lines.count(line) for line in set(lines) if lines.count(line) > 3}
        assert not repeated, repeated
