"""The CLI starts fast: `aisched --help` and a command that only talks to the control plane import neither Prefect,
Dask nor SQLAlchemy (each costs seconds a command on a loaded machine). Asserted on `sys.modules` of a fresh
interpreter, never on time; `aisched queue` and `aisched workers` name workers, not addresses."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("prefect", "distributed", "dask", "sqlalchemy", "blocks", "aisched_prefect.control.service")

QUEUE = {
    "queued": 1, "running": 1, "fractions": 0, "preempted": 0, "weights": {"team-a": 2.0},
    "free": {"tls://127.0.0.1:45181": 0, "tls://127.0.0.1:45999": 2},
    "names": {"tls://127.0.0.1:45181": "gpu-a", "tls://127.0.0.1:45999": "gpu-b"},
    "devices": {},
    "runs": [
        {"state": "running", "worker": "tls://127.0.0.1:45181", "workers": ["tls://127.0.0.1:45181"], "since": 0,
         "tenant": "team-a", "gpus": 2, "priority": 0, "preemptible": False, "estimate": 60},
        {"state": "queued", "worker": None, "workers": [], "since": 0, "tenant": "team-b", "gpus": 4, "priority": 0,
         "preemptible": False, "estimate": 60},
    ],
}
CLUSTER = {"dask": "tls://127.0.0.1:8786", "workers": [
    {"name": "gpu-a", "address": "tls://127.0.0.1:45181", "held": {}, "usage": {}, "free": {}, "runs": {},
     "inventory": {"devices": [], "source": "declared", "host": "h"}},
]}


@pytest.fixture
def fake_plane():
    """A stand-in control plane answering the two GET routes these commands read (no auth: the CLI's part only)."""
    answers = {"/v1/queue": QUEUE, "/v1/cluster": CLUSTER}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = json.dumps(answers[self.path]).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def run_cli(args: list[str], tmp_path: Path) -> tuple[dict, str]:
    """Run `aisched ARGS` in a fresh interpreter; which heavy packages it had imported by the end, and its output."""
    probe = (
        "import json, sys\n"
        "from aisched_prefect.cli import main\n"
        f"sys.argv = ['aisched', *{args!r}]\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    code = exc.code\n"
        f"print('\\nMODULES ' + json.dumps({{m: m in sys.modules for m in {HEAVY!r}}} | {{'exit': code}}))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path), "AISCHED_HOME": str(tmp_path),
           "AISCHED_OPERATOR_TOKEN": "ais_x_y"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    out, _, line = done.stdout.rpartition("MODULES ")
    assert line, done.stdout + done.stderr
    return json.loads(line), out + done.stderr


@pytest.mark.parametrize("args", [["--help"], ["queue", "--help"], ["approvals", "list", "--help"]])
def test_help_loads_no_prefect_dask_or_sqlalchemy(args, tmp_path):
    loaded, out = run_cli(args, tmp_path)
    assert loaded.pop("exit") in (0, None) and "Usage" in out, out
    assert not any(loaded.values()), f"`aisched {' '.join(args)}` imported {[m for m, v in loaded.items() if v]}"


def test_a_command_that_talks_to_the_plane_loads_only_what_it_needs_and_names_workers(fake_plane, tmp_path):
    loaded, out = run_cli(["queue", "--control-plane", fake_plane], tmp_path)
    assert loaded.pop("exit") in (0, None), out
    assert not any(loaded.values()), f"`aisched queue` imported {[m for m, v in loaded.items() if v]}"
    assert "free GPUs: gpu-a 0, gpu-b 2" in out and "tls://" not in out, out
    (running,) = [line for line in out.splitlines() if "running │" in line]
    assert "team-a" in running and "gpu-a" in running, out  # the run's row names its worker
    loaded, out = run_cli(["workers", "--control-plane", fake_plane], tmp_path)
    assert loaded.pop("exit") in (0, None) and "gpu-a" in out and "no GPUs" in out, out
    assert not any(loaded.values()), f"`aisched workers` imported {[m for m, v in loaded.items() if v]}"


def test_the_package_still_exports_its_public_names():
    """Imported on first use, the public names are the same objects as before, `import *` included."""
    import aisched_prefect
    from aisched_prefect.flow.task import ai_task

    assert aisched_prefect.ai_task is ai_task and "AISchedTaskRunner" in aisched_prefect.__all__
    namespace: dict = {}
    exec("from aisched_prefect import *", namespace)
    assert set(aisched_prefect.__all__) <= set(namespace)
    assert aisched_prefect.ledger.Ledger is aisched_prefect.Ledger  # submodules are attributes, as before
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        aisched_prefect.nope  # noqa: B018


def test_print_key_is_the_key_workers_trust_and_loads_nothing_heavy(tmp_path):
    """`aisched serve --print-key` runs before workers start (their --trust-key): it must be quick, and right."""
    loaded, out = run_cli(["serve", "--print-key"], tmp_path)
    assert loaded.pop("exit") in (0, None), out
    assert not any(loaded.values()), f"`aisched serve --print-key` imported {[m for m, v in loaded.items() if v]}"
    from aisched_prefect.control.service import load_or_make_key
    from dask_gpu.tickets import TicketSigner

    assert out.split()[0] == TicketSigner(load_or_make_key(tmp_path / "control.key")).public_key.hex()
