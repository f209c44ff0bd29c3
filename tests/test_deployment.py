"""The nightly example as a real deployment: server process, process work pool, worker, scheduled flow run.

Starts what `make demo-server` starts (a `prefect server start` on a free
127.0.0.1 port, the `aisched-local` process pool, `prefect deploy --all` from
prefect.yaml, a worker), runs the nightly training deployment, and checks
that its promotion step suspends the run (no process left, no budget held),
that alice's `aisched approve` at the control plane resumes it, and that the
resumed run completes without running or charging anything twice. One server
(and control plane, and worker) serves both tests.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aisched_prefect.ledger import Ledger
from flows.demo_server import NIGHTLY, DemoServer
from tests.helpers import processes_with

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _aisched(demo: DemoServer, *args: str) -> str:
    """The CLI as alice runs it: her approver credential, the demo's control plane."""
    done = subprocess.run([str(Path(sys.executable).with_name("aisched")), *args, "--token-file",
                           str(demo.home / "alice.token")], env=demo.env(), text=True, capture_output=True, timeout=120)
    assert done.returncode == 0, f"aisched {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _task_runs(demo: DemoServer, flow_run_id: str) -> list[dict]:
    import httpx

    resp = httpx.post(f"{demo.api}/task_runs/filter", json={"flow_runs": {"id": {"any_": [flow_run_id]}}}, timeout=30)
    resp.raise_for_status()
    return resp.json()


def _steps(demo: DemoServer, flow_run_id: str) -> dict[str, list[str]]:
    """Each step's task runs by their state's name, as the run page draws them."""
    steps: dict[str, list[str]] = {}
    for run in _task_runs(demo, flow_run_id):
        steps.setdefault(run["name"].rsplit("-", 1)[0], []).append(run["state"]["name"])
    return steps


def _step_message(demo: DemoServer, flow_run_id: str, step: str) -> str:
    return " ".join(r["state"]["message"] or "" for r in _task_runs(demo, flow_run_id)
                    if r["name"].rsplit("-", 1)[0] == step)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    server = DemoServer(tmp_path_factory.mktemp("deploy") / "aisched", _free_port())
    try:
        server.start()
        yield server
    finally:
        server.stop()


def test_nightly_deployment_suspends_for_approval_and_resumes_on_its_worker(demo):
    flow_run = demo.run(NIGHTLY)
    kind, name = demo.wait(flow_run, {"Suspended"}, timeout=300)
    worker_log = (demo.home / "worker.log").read_text(errors="replace")
    assert name == "Suspended", f"the nightly run ended {name}, not suspended for approval:\n{worker_log[-4000:]}"
    ledger = Ledger(f"sqlite:///{demo.home / 'ledger.db'}")

    # While it waits: no process of that flow run, and nothing of its budget held.
    deadline = time.time() + 60  # the flow process closes its runner (Dask cluster, ledger) and exits
    while processes_with(f"PREFECT__FLOW_RUN_ID={flow_run}") and time.time() < deadline:
        time.sleep(0.5)
    assert not processes_with(f"PREFECT__FLOW_RUN_ID={flow_run}"), "a suspended run must not keep a process"
    assert demo.state(flow_run)[1] == "Suspended"
    steps = _steps(demo, flow_run)  # the UI draws the promotion step Suspended, not a red Failed
    assert steps["promote_to_registry"] == ["Suspended"] and "Failed" not in str(steps), steps
    assert "suspended until a person answers the approval of 'promote_to_registry'" in _step_message(
        demo, flow_run, "promote_to_registry")
    suspended = [r for r in ledger.records(flow_run) if r.kind == "approval-suspended"]
    assert [r.payload["task"] for r in suspended] == ["promote_to_registry"]
    assert all(a["pending"] == 0 for a in ledger.accounts()), "a suspended run holds no budget"
    charged_before = {(a["budget"], a["period"]): a["posted"] for a in ledger.accounts()}

    waiting = [json.loads(line) for line in _aisched(demo, "approvals", "list", "--json").splitlines()]
    assert [w["task_name"] for w in waiting] == ["promote_to_registry"] and waiting[0]["status"] == "suspended"
    _aisched(demo, "approve", waiting[0]["id"], "--reason", "eval looks right")

    kind, name = demo.wait(flow_run, {"Completed"}, timeout=300)
    assert kind == "COMPLETED", f"resumed run ended {name}:\n{(demo.home / 'worker.log').read_text()[-4000:]}"
    steps = _steps(demo, flow_run)  # the re-run's promotion completed; the suspended attempt stays Suspended
    assert "Completed" in steps["promote_to_registry"] and "Failed" not in str(steps), steps
    records = ledger.records(flow_run)
    assert not _aisched(demo, "approvals", "list", "--json").strip(), "nothing waits any more"

    # Each AI task call was admitted and charged exactly once: train and evaluate (completed before the
    # suspension) were read back from their persisted results on the re-run, not run again.
    charged = [r.payload["task"] for r in records if r.kind == "settlement" and r.payload.get("outcome") == "completed"]
    assert sorted(charged) == ["evaluate", "promote_to_registry", "train"], charged
    approval = [r.payload for r in records if r.kind == "approval"]
    assert len(approval) == 1 and approval[0]["approver"] == "alice" and approval[0]["approved"] is True
    assert approval[0]["reason"] == "eval looks right"
    # The promotion's first holds were released at the suspension (voided, never charged); every account
    # posted exactly what its charged holds say, so nothing was charged twice.
    holds = ledger.history(limit=1000)
    first = {r.task_run_id for r in records if r.kind == "approval-suspended"}
    assert {h["status"] for h in holds if h["task_run_id"] in first} == {"voided"}
    for a in ledger.accounts():
        charged_here = sum(h["charged"] or 0 for h in holds if (h["budget"], h["period"]) == (a["budget"], a["period"]))
        assert a["posted"] == pytest.approx(charged_here, abs=1e-6), a
        assert a["pending"] == 0
    promoted = {r.task_run_id for r in records if r.kind == "settlement" and r.payload.get("task") == "promote_to_registry"}
    assert len(promoted) == 1 and not promoted & first
    for a in ledger.accounts():  # after the resume, only the promotion's own charge was added
        key = (a["budget"], a["period"])
        added = sum(h["charged"] or 0 for h in holds if h["task_run_id"] in promoted and (h["budget"], h["period"]) == key)
        assert a["posted"] == pytest.approx(charged_before.get(key, 0.0) + added, abs=1e-6), a
    assert ledger.verify().ok


def _registry(demo: DemoServer) -> dict[str, bytes]:
    root = demo.home / "examples" / "registry"
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()} if root.exists() else {}


def test_a_rejected_suspended_run_resumes_without_its_promotion_and_charges_nothing_for_it(demo):
    registry_before = _registry(demo)  # the module's first test promoted a model: this run must not touch it
    flow_run = demo.run(NIGHTLY)
    assert demo.wait(flow_run, {"Suspended"}, timeout=300)[1] == "Suspended"
    ledger = Ledger(f"sqlite:///{demo.home / 'ledger.db'}")
    (waiting,) = [json.loads(line) for line in _aisched(demo, "approvals", "list", "--json").splitlines()]
    _aisched(demo, "reject", waiting["id"], "--reason", "eval regressed")

    kind, name = demo.wait(flow_run, {"Completed"}, timeout=300)
    assert kind == "COMPLETED", f"resumed run ended {name}:\n{(demo.home / 'worker.log').read_text()[-4000:]}"
    records = ledger.records(flow_run)
    decision = [r.payload for r in records if r.kind == "approval"]
    assert len(decision) == 1 and decision[0]["approved"] is False and decision[0]["approver"] == "alice"
    assert "eval regressed" in decision[0]["reason"]
    promotion = [r for r in records if r.payload.get("task") == "promote_to_registry"]
    assert not [r for r in promotion if r.kind in ("admission", "settlement")], "a rejected promotion never runs"
    holds = [h for h in ledger.history(limit=1000) if h["task_run_id"] in {r.task_run_id for r in promotion}]
    assert holds and {h["status"] for h in holds} == {"voided"} and all(not h["charged"] for h in holds)
    assert _registry(demo) == registry_before, "a rejected promotion writes nothing to the registry"
    assert ledger.verify().ok
