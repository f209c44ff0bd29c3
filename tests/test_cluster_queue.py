"""The cluster's one queue as an operator sees it through the control plane: `aisched queue` (GET /v1/queue with an
operator token), the ClusterBlock's tenant weights reaching the queue when it is applied, and a control plane (the
queue's only client) that dies leaving nothing in the queue.

(What the runner-era file also asserted is in tests/test_queue_default.py on the control plane: runs of two tenants
share the queue fairly, and Dask never holds more GPU runs than fit.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prefect import flow
from typer.testing import CliRunner

from aisched_prefect import AISchedTaskRunner, ai_task
from aisched_prefect.cli import app
from blocks import ClusterBlock
from tests.helpers import authority, tenant

pytestmark = pytest.mark.usefixtures("prefect_api")

REPO = Path(__file__).resolve().parent.parent


@ai_task(gpus=2, gpu_type="H100", kind="training", est_seconds=4)
def train_longer(i):
    start = time.time()
    time.sleep(1.5)
    return start


@ai_task(gpus=2, gpu_type="H100", kind="training", est_seconds=2)
def train(i):
    time.sleep(0.3)
    return i


def operator_token_file(plane, tmp_path: Path) -> str:
    path = tmp_path / "operator.token"
    path.write_text(plane.operator_token)
    return str(path)


def test_aisched_queue_shows_what_runs_and_what_waits(control_plane, tmp_path):
    """`aisched queue --json` (the control plane's GET /v1/queue): the runs on GPUs first, then those waiting, each
    with its tenant, GPUs and worker; the table names both."""
    t = tenant(control_plane, authority_=authority(principal="qshow/jobs"), principal="qshow/jobs")
    cli = CliRunner()
    args = ["queue", "--control-plane", control_plane.url, "--token-file", operator_token_file(control_plane, tmp_path)]

    @flow(name="queue-shown", task_runner=t.runner(max_workers=8))
    def jobs():
        return [f.result() for f in train_longer.map(range(4))]

    worker = threading.Thread(target=jobs)
    worker.start()
    try:
        deadline = time.time() + 60
        while True:  # two H100 hosts: two of the tenant's runs on GPUs, two waiting
            out = cli.invoke(app, [*args, "--json"])
            assert out.exit_code == 0, out.output
            state = json.loads(out.output)
            mine = [r for r in state["runs"] if r["tenant"] == "qshow"]
            if [r["state"] for r in mine] == ["running", "running", "queued", "queued"]:
                break
            assert time.time() < deadline and worker.is_alive(), state
            time.sleep(0.05)
        assert all(r["gpus"] == 2 and not r["preemptible"] for r in mine)
        assert {r["worker"] for r in mine[:2]} <= set(state["free"]) and mine[2]["worker"] is None
        assert len({r["worker"] for r in mine[:2]}) == 2  # one per H100 host
        table = cli.invoke(app, args)
        assert table.exit_code == 0 and "waiting" in table.output and "running" in table.output, table.output
    finally:
        worker.join(timeout=120)
    after = json.loads(cli.invoke(app, [*args, "--json"]).output)
    assert not [r for r in after["runs"] if r["tenant"] == "qshow"]  # every run left the queue


def test_aisched_queue_needs_an_operator_and_names_a_wrong_address_and_a_plane_without_the_queue(
        control_plane, tmp_path, plane_home, gpu_cluster):
    from tests.controlplane import ControlPlaneProcess

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    aisched = str(Path(sys.executable).parent / "aisched")
    out = subprocess.run([aisched, "queue", "--control-plane", "http://127.0.0.1:9", "--token-file",
                          operator_token_file(control_plane, tmp_path)], capture_output=True, text=True, env=env)
    assert out.returncode == 1 and "no control plane answered at http://127.0.0.1:9" in out.stderr, out.stderr
    assert "aisched serve" in out.stderr  # the fix
    flow_token = tenant(control_plane).token
    (tmp_path / "flow.token").write_text(flow_token)
    out = subprocess.run([aisched, "queue", "--control-plane", control_plane.url, "--token-file",
                          str(tmp_path / "flow.token")], capture_output=True, text=True, env=env)
    assert out.returncode == 1 and "HTTP 403" in out.stderr and "operator" in out.stderr, out.stderr

    home = tmp_path / "no-queue"
    home.mkdir()
    shutil.copy(plane_home / "control.key", home / "control.key")  # the key the session's workers trust
    plane = ControlPlaneProcess(home, dask_address=gpu_cluster.scheduler_address, dask_tls=plane_home / "tls",
                                queue=False).start()
    try:
        out = subprocess.run([aisched, "queue", "--control-plane", plane.url, "--token-file",
                              operator_token_file(plane, tmp_path)], capture_output=True, text=True, env=env)
    finally:
        plane.stop()
    assert out.returncode == 1 and "has no queue" in out.stderr and "aisched serve" in out.stderr, out.stderr


def test_applying_a_cluster_block_sets_its_tenant_weights_on_the_queue(control_plane):
    """An operator applies a ClusterBlock: its tenant_weights are the queue's at once (the latest applied block wins
    for a tenant two blocks name); applying it again without them takes them back."""
    def weights() -> dict:
        return control_plane.ok("GET", "/v1/queue")["weights"]

    control_plane.apply("cluster", "weights-a", ClusterBlock(tenant_weights={"qw-a": 3.0, "qw-b": 0.5}))
    assert weights().items() >= {"qw-a": 3.0, "qw-b": 0.5}.items()
    control_plane.apply("cluster", "weights-b", ClusterBlock(tenant_weights={"qw-b": 2.0}))
    assert weights().items() >= {"qw-a": 3.0, "qw-b": 2.0}.items()
    control_plane.apply("cluster", "weights-a", ClusterBlock())
    control_plane.apply("cluster", "weights-b", ClusterBlock())
    assert not {"qw-a", "qw-b"} & set(weights())  # the session's queue is shared by other tests


def test_a_scheduler_queue_without_its_weights_gets_them_back(control_plane, dask_client):
    """A scheduler that restarted has a fresh queue (its preload installs one) with no tenant weights: the control
    plane sets them again every AISCHED_QUEUE_SYNC_SECONDS, without an operator applying anything."""
    from tests.conftest import QUEUE_SYNC_SECONDS

    def weights() -> dict:
        return control_plane.ok("GET", "/v1/queue")["weights"]

    def forget(dask_scheduler) -> dict:
        plugin = dask_scheduler.plugins["dask-gpu-queue"]
        plugin.set_weights({})
        return dict(plugin.policy.weights)  # read in the same step: the next sync may come any time after it

    control_plane.apply("cluster", "weights-sync", ClusterBlock(tenant_weights={"qs-a": 4.0}))
    try:
        assert weights().get("qs-a") == 4.0
        assert "qs-a" not in dask_client.run_on_scheduler(forget)
        # A hang detector, not a timing goal: the sync is a periodic chore beside others (drift, reports), which a
        # loaded machine may keep busy for many periods (CI saw more than 10 of them pass).
        deadline = time.monotonic() + max(120.0, 10 * QUEUE_SYNC_SECONDS)
        while weights().get("qs-a") != 4.0:
            assert time.monotonic() < deadline, "the control plane never set the weights again"
            time.sleep(0.1)
    finally:
        control_plane.apply("cluster", "weights-sync", ClusterBlock())


# -- a control plane that dies ------------------------------------------------------------------------------------

VICTIM = '''
import time
from prefect import flow
from aisched_prefect import AISchedTaskRunner, ai_task

@ai_task(gpus=2, gpu_type="H100", kind="training", est_seconds=60)
def hog(i):
    time.sleep(2)

@flow(task_runner=AISchedTaskRunner(control_plane={url!r}, credential={token!r}, max_workers=8))
def victim():
    [f.result() for f in hog.map(range(6))]

victim()
'''


@pytest.fixture
def own_cluster(tmp_path):
    from tests.clusterprocs import ClusterProcs

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


def test_a_dead_control_plane_leaves_nothing_in_the_queue(own_cluster, tmp_path):
    """The control plane is the queue's only client: when its process dies (SIGKILL, runs on GPUs and runs waiting),
    the scheduler drops everything it queued and frees what it ran; a control plane started again serves runs."""
    from prefect.settings import PREFECT_API_URL

    cluster = own_cluster
    t = tenant(cluster.plane, authority_=authority(principal="qdead/jobs"), principal="qdead/jobs")
    script = tmp_path / "victim.py"
    script.write_text(VICTIM.format(url=cluster.plane.url, token=t.token))
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_LOGGING_LEVEL": "CRITICAL",
           "PYTHONPATH": str(REPO)}
    victim = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        with cluster.client() as client:
            def status() -> dict:
                return client.sync(client.scheduler.gpu_queue_status)

            deadline = time.time() + 120
            while time.time() < deadline:
                s = status()
                if s["running"] >= 2 and s["queued"] >= 1:
                    break
                time.sleep(0.1)
            assert s["running"] >= 2 and s["queued"] >= 1, s
            cluster.plane.kill()  # SIGKILL: no goodbye to the scheduler
            victim.send_signal(signal.SIGKILL)
            victim.wait(timeout=30)
            for _ in range(100):  # the scheduler notices its client is gone
                s = status()
                if s["queued"] == 0 and s["running"] == 0:
                    break
                time.sleep(0.1)
            assert s["queued"] == 0 and s["running"] == 0, s
            assert all(free == 2 for free in s["free"].values()), s
    finally:
        victim.kill()
    plane = cluster.start_plane()  # same home: the same ledger, key and credentials

    @flow(task_runner=AISchedTaskRunner(control_plane=plane.url, credential=t.token, max_workers=4))
    def survivor():
        return [f.result() for f in train.map(range(2))]

    assert survivor() == [0, 1]
