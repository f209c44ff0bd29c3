"""The scheduler's HTTP server shows a neighbour nothing about other tenants' runs, and no Dask key names a run.

Before: `dask-gpu-scheduler` as docs/how-to/gpu-cluster.md starts it (`--tls-dir`, `--dashboard-address
127.0.0.1:8787`) mounted every route of Dask's `distributed.scheduler.http.routes`: `/info`, `/json`, `/metrics`
and `/eventstream` answered anyone who reached the port (a body on the scheduler's host: loopback), without a
certificate, with the task keys, and each admitted run's key was `aisched-{task}-{task_run_id}-...`: another
tenant's task names and Prefect task-run ids. Now it answers `/health` only unless the operator passes
`--dashboard`, which it takes on loopback only; and a run's Dask key is opaque (the control plane maps it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote

import httpx
import pytest

from tests.attacks.support import wait_for

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
# Dask's own routes a browser or a script would read: task keys, workers, logs, metrics per task prefix.
PROBES = ("/info", "/info/main/workers.html", "/info/main/logs.html", "/info/task/{key}.html", "/json/identity.json",
          "/json/counts.json", "/json/index.html", "/metrics", "/eventstream", "/individual-plots.json",
          "/proxy/8888/127.0.0.1/status", "/statics/")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_DISTRIBUTED__SCHEDULER__HTTP")}
    (tmp / "dask-tmp").mkdir(exist_ok=True)
    return {**env, "PYTHONPATH": str(REPO), "DASK_TEMPORARY_DIRECTORY": str(tmp / "dask-tmp")}


class Scheduler:
    """`dask-gpu-scheduler --tls-dir DIR --port 0 --dashboard-address 127.0.0.1:PORT` (the page's command, a free
    port), in a session of its own; `stop()` ends it by its pid once /proc says it is still that process."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.tls, self.http = tmp / "tls", _free_port()
        self.file = tmp / f"scheduler-{uuid.uuid4().hex[:6]}.json"
        self.log = tmp / f"{self.file.stem}.log"
        cmd = [str(BIN / "dask-gpu-scheduler"), "--tls-dir", str(self.tls), "--port", "0", "--dashboard-address",
               f"127.0.0.1:{self.http}", "--scheduler-file", str(self.file), *extra]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, env=_env(tmp), stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.url = f"http://127.0.0.1:{self.http}"

        def up() -> bool:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                return self.file.exists() and httpx.get(f"{self.url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 60, "the scheduler's /health")
        import json

        self.address = json.loads(self.file.read_text())["address"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            cmdline = Path(f"/proc/{self.proc.pid}/cmdline").read_bytes().split(b"\0")
            assert str(self.file).encode() in cmdline, cmdline  # still the scheduler this test started
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _hold_a_task(scheduler: Scheduler, key: str):
    """A client of the control plane's certificate that leaves `key` waiting on the scheduler (no worker runs it)."""
    from distributed import Client

    from dask_gpu.security import ClusterTLS

    client = Client(scheduler.address, set_as_default=False, security=ClusterTLS(scheduler.tls).security("client"),
                    timeout=30)
    future = client.submit(int, "1", key=key, pure=False)
    wait_for(lambda: client.run_on_scheduler(lambda dask_scheduler: key in dask_scheduler.tasks, wait=True), 30,
             "the scheduler to hold the task")
    return client, future


def test_the_schedulers_http_server_answers_health_only_unless_the_operator_turns_the_dashboard_on(tmp_path):
    key = f"aisched-secret_finetune_project-{uuid.uuid4()}-deadbeef"  # the shape keys had before
    scheduler = Scheduler(tmp_path)
    client = future = None
    try:
        client, future = _hold_a_task(scheduler, key)
        assert httpx.get(f"{scheduler.url}/health").text == "ok"
        for path in PROBES:
            resp = httpx.get(scheduler.url + path.format(key=quote(key)), timeout=10)
            assert resp.status_code == 404, (path, resp.status_code, resp.text[:200])
            assert "secret_finetune_project" not in resp.text, path
        assert "/health only" in scheduler.log.read_text()
    finally:
        if client is not None:
            client.close()
        scheduler.stop()

    # The operator's choice: --dashboard, on loopback, serves Dask's routes (the probes above are the real paths).
    dashboard = Scheduler(tmp_path, "--dashboard")
    client = None
    try:
        client, future = _hold_a_task(dashboard, key)
        shown = httpx.get(f"{dashboard.url}/info/task/{quote(key)}.html", timeout=10)
        assert shown.status_code == 200 and "secret_finetune_project" in shown.text
        assert httpx.get(f"{dashboard.url}/json/identity.json", timeout=10).status_code == 200
        assert httpx.get(f"{dashboard.url}/eventstream", timeout=10).status_code == 400  # mounted: a websocket
    finally:
        if client is not None:
            client.close()
        dashboard.stop()


@pytest.mark.parametrize("args, says", [
    (["--dashboard", "--dashboard-address", "0.0.0.0:{port}"], "--dashboard-address 0.0.0.0:{port}. Fix:"),
    (["--dashboard", "--dashboard-address", ":{port}"], "loopback only, not --dashboard-address :{port}. Fix:"),
    (["--jupyter"], "--jupyter serves a Python server"),
])
def test_the_dashboard_is_refused_beyond_loopback_and_jupyter_always(tmp_path, args, says):
    port = _free_port()
    done = subprocess.run([str(BIN / "dask-gpu-scheduler"), "--no-tls", "--port", "0",
                           *[a.format(port=port) for a in args]], env=_env(tmp_path), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1, done
    assert done.stderr.startswith("dask-gpu-scheduler: ") and done.stderr.count("\n") == 1, done.stderr
    assert says.format(port=port) in done.stderr
    assert done.stdout == ""


def test_the_dask_key_of_an_admitted_run_names_neither_its_task_nor_its_task_run(sqlite_url):
    """Dispatcher._register makes the key every Dask message, worker log and the scheduler's state carry; the
    control plane keeps key -> run in its own table (`running`), and the ticket registry finds its runs by prefix."""
    from aisched_prefect.control.admission.record import Admission
    from aisched_prefect.control.dispatch.dispatcher import Dispatcher
    from aisched_prefect.request import AIRequest
    from dask_gpu.tickets import KEY_PREFIX

    client = SimpleNamespace(subscribe_topic=lambda *a, **k: None, _stream_handlers={})
    from aisched_prefect.ledger import Ledger
    from aisched_prefect.settings import Settings

    dispatcher = Dispatcher(client, signer=None, ledger=Ledger(sqlite_url), state=None,  # type: ignore[arg-type]
                            settings=Settings())
    keys = []
    for _ in range(2):
        admission = Admission.model_construct(
            id=str(uuid.uuid4()), task_name="secret_finetune_project", task_run_id=str(uuid.uuid4()),
            flow_run_id=str(uuid.uuid4()), principal="team-b/secret-project", tenant="team-b", holds=[],
            request=AIRequest(kind="training", gpus=1, est_seconds=30))
        state = dispatcher._register(admission)
        for secret in (admission.task_name, admission.task_run_id, admission.task_run_id.replace("-", ""),
                       admission.flow_run_id, admission.principal, "secret", "team-b"):
            assert secret not in state.key, (secret, state.key)
        assert state.key.startswith(KEY_PREFIX)  # what the ticket registry and the workers look for
        assert dispatcher.running[state.key].admission is admission  # the plane maps it back
        keys.append(state.key)
    assert keys[0] != keys[1]
