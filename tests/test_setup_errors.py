"""Set-up mistakes end a flow script on one line naming the fix (the traceback only with AISCHED_TRACEBACK=1).

Each mistake is made as a user would make it, in a script of its own run as `python FILE` against the session's
Prefect server (and, where it needs one, the session's control plane): a wrong or expired token, no token, a token
without a control plane address, a plane that does not answer, an AI task outside a flow or under Prefect's default
runner, a `__main__` task whose module state cannot travel; and a scheduler port in use, an example flow's
abbreviated option.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import processes_with, tenant, wait_until

SCRIPT = '''
import sys, threading
from prefect import flow
from aisched_prefect import ai_task, AISchedTaskRunner

LOCK = threading.Lock()  # module state a `__main__` task may carry (mode "state")

@ai_task(gpus=1, kind="training", est_seconds=5)
def double(x):
    return 2 * x

@ai_task(gpus=1, kind="training", est_seconds=5)
def locked(x):
    with LOCK:
        return 2 * x

mode = sys.argv[1]
if mode == "outside":
    double(2)
elif mode == "default-runner":
    @flow
    def plain():
        return double(2)
    plain()
else:
    @flow(task_runner=AISchedTaskRunner())
    def governed():
        return (locked if mode == "state" else double)(2)
    print("result", governed())
'''
PREFECT_LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d+ \| ")  # Prefect's own log lines (one per run state)


def _run(tmp_path: Path, mode: str, **env: str) -> tuple[int, str, float]:
    from prefect.settings import PREFECT_API_URL

    script = tmp_path / "setup_flow.py"
    script.write_text(SCRIPT)
    full = {k: v for k, v in os.environ.items() if not k.startswith("AISCHED_")}
    full.update({"PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_LOGGING_LEVEL": "WARNING",
                 "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore", "AISCHED_HOME": str(tmp_path / "home"), **env})
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, env=full, timeout=300,
                          cwd=tmp_path)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def _one_line(out: str, error: str, *words: str) -> str:
    """The script's own output (Prefect's log lines aside) is the error's one line and the hint; returned."""
    assert "Traceback" not in out, out
    own = [line for line in out.splitlines() if line.strip() and not PREFECT_LINE.match(line)]
    assert len(own) == 2, out
    assert own[0].startswith(f"{error}: ") and "Fix: " in own[0], own[0]
    assert own[1] == "(the whole traceback: AISCHED_TRACEBACK=1)"
    for word in words:
        assert word in own[0], (word, own[0])
    for line in out.splitlines():  # each of Prefect's lines about it is one line too (no traceback under it)
        assert PREFECT_LINE.match(line) or line in own or not line.strip(), line
    return own[0]


def test_a_wrong_token_is_one_line_with_the_fix_and_the_traceback_only_when_asked(control_plane, tmp_path):
    env = {"AISCHED_CONTROL_PLANE": control_plane.url, "AISCHED_TOKEN": "ais_0123456789abcdef_wrong"}
    code, out, _ = _run(tmp_path, "governed", **env)
    assert code == 1
    _one_line(out, "CredentialRefused", "AISCHED_TOKEN", control_plane.url)
    code, out, _ = _run(tmp_path, "governed", **env, AISCHED_TRACEBACK="1")
    assert code == 1 and "Traceback (most recent call last)" in out and "CredentialRefused" in out


def test_an_expired_token_is_one_line_naming_its_expiry(control_plane, tmp_path):
    t = tenant(control_plane)
    token = control_plane.ok("POST", "/v1/credentials", json={
        "principal": t.principal, "authority": t.authority, "budget": t.budget, "expires_in": 1.0})["token"]
    time.sleep(1.5)  # the credential's own expiry, not a wait on an event
    code, out, _ = _run(tmp_path, "governed", AISCHED_CONTROL_PLANE=control_plane.url, AISCHED_TOKEN=token)
    assert code == 1
    _one_line(out, "CredentialRefused", "expired")


def test_no_token_and_a_token_without_a_plane_are_each_one_line_naming_the_setting(control_plane, tmp_path):
    code, out, _ = _run(tmp_path, "governed", AISCHED_CONTROL_PLANE=control_plane.url)
    assert code == 1
    _one_line(out, "ConfigurationError", "AISCHED_TOKEN")
    code, out, _ = _run(tmp_path, "governed", AISCHED_TOKEN="ais_0123456789abcdef_orphan")
    assert code == 1
    _one_line(out, "ConfigurationError", "AISCHED_TOKEN is set but no control plane address", "AISCHED_CONTROL_PLANE")


def test_a_plane_that_does_not_answer_is_said_in_one_line_within_seconds(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens here once closed
    code, out, _ = _run(tmp_path, "governed", AISCHED_CONTROL_PLANE=f"http://127.0.0.1:{closed}",
                        AISCHED_TOKEN="ais_0123456789abcdef_any")
    assert code == 1
    _one_line(out, "ControlPlaneUnavailable", f"127.0.0.1:{closed}", "AISCHED_CONTROL_PLANE")


def test_a_plane_that_refuses_connections_is_given_up_on_within_seconds():
    from aisched_prefect.flow.client import FIRST_CONTACT_SECONDS, ControlPlaneClient, ControlPlaneUnavailable

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    client = ControlPlaneClient([f"http://127.0.0.1:{closed}"], "ais_0123456789abcdef_any")
    started = time.monotonic()
    with pytest.raises(ControlPlaneUnavailable, match="Fix: "):
        client.whoami(first=True)
    took = time.monotonic() - started
    client.close()
    assert took < 3 * FIRST_CONTACT_SECONDS  # seconds (the client's default retries for 30 s, then said so)


@pytest.mark.parametrize("mode", ["outside", "default-runner"])
def test_an_ai_task_outside_its_runner_is_one_line(tmp_path, mode):
    code, out, _ = _run(tmp_path, mode)
    assert code == 1
    _one_line(out, "NoAdmissionContext", "AISchedTaskRunner")


def test_a_main_task_whose_module_state_cannot_travel_is_one_line(control_plane, tmp_path):
    t = tenant(control_plane)
    code, out, _ = _run(tmp_path, "state", AISCHED_CONTROL_PLANE=control_plane.url, AISCHED_TOKEN=t.token)
    assert code == 1
    _one_line(out, "UnshippableCode", "cannot pickle", "python -m")
    assert "could not publish" not in out  # nothing ran: no artifact to complain about


def test_a_scheduler_port_in_use_is_one_line():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "dask_gpu.scheduler.cli", "--no-tls", "--port", str(port),
                               "--dashboard-address", "127.0.0.1:0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert f"127.0.0.1:{port} is in use" in line and "Fix: " in line and "--port" in line


def test_an_example_flow_refuses_an_abbreviated_option():
    done = subprocess.run([sys.executable, "-m", "flows.batch_inference", "--shard", "3"], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 2
    assert "unrecognized arguments: --shard 3" in done.stderr


def test_the_control_plane_refuses_a_port_in_use_in_one_line(tmp_path):
    """... and stops the local cluster it had begun starting before it tried the port."""
    mark = f"AISCHED_TEST_MARK=port-{tmp_path.name}"
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "aisched_prefect.control.server", "--port", str(port),
                               "--declared", "1 worker x 1 GPU, 24 GB, A10"], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "AISCHED_HOME": str(tmp_path),
                                                "AISCHED_TEST_MARK": mark.split("=", 1)[1]})
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "Fix: " in done.stderr
    wait_until(lambda: not processes_with(mark), 60, f"every process carrying {mark} to end")


def test_a_control_plane_that_cannot_open_its_ledger_says_so_in_one_line_and_leaves_nothing_running(tmp_path):
    """Its database refuses connections: one line naming the ledger (without its password) and the fix, not a
    driver's traceback; and none of the local cluster's processes, which start before the plane opens its ledger,
    outlive it."""
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]  # nothing listens there once this block ends
    mark = f"AISCHED_TEST_MARK=ledger-{tmp_path.name}"
    done = subprocess.run([sys.executable, "-m", "aisched_prefect.control.server", "--port", "0",
                           "--declared", "1 worker x 1 GPU, 24 GB, A10"], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "AISCHED_HOME": str(tmp_path), "AISCHED_TEST_MARK": mark.split("=", 1)[1],
                               "AISCHED_LEDGER_URL": f"postgresql://nobody:s3cret@127.0.0.1:{port}/none"})
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"cannot open the ledger at postgresql://nobody:***@127.0.0.1:{port}/none" in done.stderr, done.stderr
    assert "Fix: " in done.stderr and "s3cret" not in done.stderr
    wait_until(lambda: not processes_with(mark), 60, f"every process carrying {mark} to end")


def test_the_walk_through_exports_prefect_api_url_before_it_starts_the_server():
    """The server's UI calls the API PREFECT_API_URL names when it starts: exported after, a UI on another port
    would call 127.0.0.1:4200, which on a shared host can be someone else's server."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "how-to" / "gpu-cluster.md").read_text()
    exported = page.index("export PREFECT_API_URL=")
    assert exported < page.index("prefect server start")
