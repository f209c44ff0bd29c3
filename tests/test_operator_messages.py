"""What an operator reads: where the cluster's processes listen by default, a GPU type no worker has, a rejection,
and `aisched evidence show` keeping operators' records apart from task runs. Pure parts, no server."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from aisched_prefect.cli import app
from aisched_prefect.errors import AdmissionDenied

runner = CliRunner()


def test_the_scheduler_listens_on_loopback_unless_told():
    from dask_gpu.scheduler.cli import listen_defaults

    assert listen_defaults(["--port", "8786"]) == ["--port", "8786", "--host", "127.0.0.1",
                                                    "--dashboard-address", "127.0.0.1:8787"]
    # Told: the scheduler host of a multi-host cluster; its dashboard (no login) stays on loopback unless told too.
    assert listen_defaults(["--host", "0.0.0.0"]) == ["--host", "0.0.0.0", "--dashboard-address", "127.0.0.1:8787"]
    assert listen_defaults(["--interface=eth0", "--dashboard-address", ":8787"]) == [
        "--interface=eth0", "--dashboard-address", ":8787"]


def test_a_worker_listens_on_its_address_that_reaches_the_scheduler_unless_told():
    from dask_gpu.worker.cli import listen_defaults

    got = listen_defaults(["tls://127.0.0.1:8786", "--name", "gpu-a", "--no-dashboard"])
    assert got[-4:] == ["--host", "127.0.0.1", "--dashboard-address", "127.0.0.1:0"], got
    assert listen_defaults(["tls://127.0.0.1:8786", "--host", "10.0.0.5"])[-2:] == ["--dashboard-address", "10.0.0.5:0"]
    told = ["tls://127.0.0.1:8786", "--listen-address", "tls://0.0.0.0:9000", "--dashboard-address", ":8788"]
    assert listen_defaults(told) == told  # the operator's choice stands


def _inventories(spec: str) -> dict:
    from dask_gpu import declared_worker_inventories

    return {f"gpu-{i}": inv for i, inv in enumerate(declared_worker_inventories(spec))}


def test_a_gpu_type_no_worker_has_is_named_with_what_the_cluster_has():
    from aisched_prefect.control.admission.stages import feasibility
    from aisched_prefect.request import AIRequest

    cluster = _inventories("2 workers x 2 GPUs, 80 GB, H100; 1 worker x 1 GPU, 24 GB, A10")
    with pytest.raises(AdmissionDenied) as denied:
        feasibility(AIRequest(kind="training", gpus=1, gpu_type="B200", est_seconds=60), cluster)
    assert denied.value.stage == "feasibility"
    assert denied.value.reason == "no worker has GPU type 'B200' (the cluster has: A10 x1, H100 x4)"
    assert "gpu_type one of A10, H100" in denied.value.fix and "add a worker with 'B200' GPUs" in denied.value.fix
    # A type the cluster has, but more of it than any worker holds: the placement message, as before.
    with pytest.raises(AdmissionDenied, match="fits no worker"):
        feasibility(AIRequest(kind="training", gpus=2, gpu_type="A10", est_seconds=60), cluster)
    workers, types = feasibility(AIRequest(kind="training", gpus=1, gpu_type=("b200", "a10"), est_seconds=60), cluster)
    assert workers == ["gpu-2"] and types == ["A10"]


def test_admission_places_a_run_only_on_workers_that_serve_its_tenant():
    """A worker started for one tenant (`--tenant`, as every worker in a Slurm job is) advertises it; admission
    names only the workers that serve the caller's tenant (and those that serve any), so no run is sent to a worker
    that would refuse it, and a tenant no worker serves is told so with the fix."""
    from aisched_prefect.control.admission.stages import feasibility
    from aisched_prefect.request import AIRequest

    cluster = _inventories("3 workers x 1 GPU, 80 GB, H100")
    cluster["gpu-0"] = cluster["gpu-0"].model_copy(update={"tenant": "team-a"})
    cluster["gpu-1"] = cluster["gpu-1"].model_copy(update={"tenant": "team-b"})
    one = AIRequest(kind="training", gpus=1, gpu_type="H100", est_seconds=60)
    assert feasibility(one, cluster, "team-a")[0] == ["gpu-0", "gpu-2"]
    assert feasibility(one, cluster, "team-c")[0] == ["gpu-2"]
    del cluster["gpu-2"]
    with pytest.raises(AdmissionDenied) as denied:
        feasibility(one, cluster, "team-c")
    assert "no worker serves tenant 'team-c'" in denied.value.reason and "--tenant team-c" in denied.value.fix


def test_reject_says_the_run_will_not_start(monkeypatch):
    from aisched_prefect.cli import common

    class Plane:
        _token = "t"

        def post(self, path, body):
            assert path == "/v1/approvals/11/answer" and body["approve"] is False
            return {"status": "rejected", "approved_by": []}

    monkeypatch.setattr(common, "plane", lambda *a, **k: Plane())
    out = runner.invoke(app, ["reject", "11", "--reason", "not tonight"])
    assert out.exit_code == 0, out.output
    assert "rejected 11: the run will not start and its hold is released" in out.output
    assert "approved by" not in out.output


def test_evidence_show_keeps_operators_records_apart_from_task_runs(sqlite_url):
    from aisched_prefect.ledger import BudgetLine, Ledger

    ledger = Ledger(sqlite_url)
    ledger.record("credential-issued", {"credential": {"id": "c1", "principal": "team-a/nightly", "role": "flow",
                                                       "tenant": "team-a", "authority": "team-a"}, "by": "operator"},
                  principal="operator")
    ledger.record("config-applied", {"kind": "budget", "name": "team-a", "version": 3, "digest": "ab" * 32,
                                     "body": {}, "by": "operator"}, principal="operator")
    holds, _ = ledger.reserve([BudgetLine(budget="team-a", period="2026-12", limit=5)], 1.0, kind="admission",
                              payload={"task": "train", "request": {"kind": "training", "gpus": 2}, "grant": "root"},
                              flow_run_id="f", task_run_id="t1", principal="team-a/nightly")
    ledger.settle([h.id for h in holds], 0.5, kind="settlement", task_run_id="t1", flow_run_id="f",
                  principal="team-a/nightly", payload={"task": "train", "outcome": "completed", "placement": {
                      "worker": "tls://127.0.0.1:45181", "name": "gpu-a", "devices": ["0", "1"]}})
    out = runner.invoke(app, ["evidence", "show", "--ledger", sqlite_url])
    assert out.exit_code == 0, out.output
    tasks, _, operators = out.output.partition("operators' records")
    (row,) = [line for line in tasks.splitlines() if "│ train" in line]
    assert "gpu-a" in row and "completed" in row and "tls://" not in tasks
    assert "credential-issued" not in tasks and "│ ?" not in tasks  # no operator record as a task row
    assert "flow credential c1 for team-a/nightly (tenant team-a; authority team-a)" in operators
    assert "budget 'team-a' applied: version 3 (abababababab)" in operators


def test_evidence_show_limits_each_table_to_its_last_rows_and_says_so(sqlite_url):
    from aisched_prefect.ledger import BudgetLine, Ledger

    ledger = Ledger(sqlite_url)
    for i in range(5):
        holds, _ = ledger.reserve([BudgetLine(budget="team-a", period="2026-12", limit=50)], 1.0, kind="admission",
                                  payload={"task": f"shard-{i}", "request": {"kind": "inference", "gpus": 1},
                                           "grant": "root"}, flow_run_id="f", task_run_id=f"t{i}",
                                  principal="team-a/batch")
        ledger.settle([h.id for h in holds], 0.5, kind="settlement", task_run_id=f"t{i}", flow_run_id="f",
                      principal="team-a/batch", payload={"task": f"shard-{i}", "outcome": "completed"})
    out = runner.invoke(app, ["evidence", "show", "--ledger", sqlite_url, "--limit", "2"])
    assert out.exit_code == 0, out.output
    shown = [line for line in out.output.splitlines() if "│ shard-" in line]
    assert len(shown) == 2 and "shard-3" in shown[0] and "shard-4" in shown[1], out.output
    assert "AI task runs: the last 2 of 5 rows (--limit 0 shows all" in out.output
    everything = runner.invoke(app, ["evidence", "show", "--ledger", sqlite_url, "--limit", "0"])
    assert len([line for line in everything.output.splitlines() if "│ shard-" in line]) == 5


def test_a_run_waiting_for_a_person_says_who_must_answer_what_and_where(caplog):
    """The flow's log, not only Prefect's 'Pausing flow': the task, how many approvers, the rule, what is held, the
    page's link, the CLI answer and when silence denies it."""
    import logging

    from aisched_prefect.flow.approval_wait import say_waiting
    from aisched_prefect.wire import ApprovalView

    view = ApprovalView(id="3f2a9c81d0e4b5a6c7d8e9f0a1b2c3d4", status="pending", digest="d" * 64, task_name="promote",
                        task_run_id="t", flow_run_id="f", principal="team-a/nightly", rule="promotions",
                        est_cost=1.25, deadline=1_796_000_000.0, timeout_seconds=43200, approvals_required=2,
                        url="http://127.0.0.1:8790/approve/3f2a9c81d0e4b5a6c7d8e9f0a1b2c3d4")
    with caplog.at_level(logging.WARNING, logger="aisched_prefect"):
        say_waiting(view)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "AI task 'promote' waits for 2 approvers (approval rule 'promotions', 1.2500 USD held)" in line
    assert "answer at http://127.0.0.1:8790/approve/3f2a9c81d0e4b5a6c7d8e9f0a1b2c3d4" in line
    assert "aisched approve 3f2a9c81 --reason" in line and "open until 2026-11-30 00:53 UTC" in line, line


def test_a_denial_that_ends_the_script_prints_its_reason_and_fix_once_not_a_traceback(capsys, monkeypatch):
    """The hook the runner installs: a denial (an expected outcome, its message the reason and the fix) is one line
    on stderr; AISCHED_TRACEBACK=1, or any other exception, goes to the hook that was there before."""
    import sys

    from aisched_prefect.errors import AdmissionDenied
    from aisched_prefect.logs import one_line

    seen: list[type] = []
    denied = AdmissionDenied("budget", "budget 'team-a' has 0.50 USD left", "raise the budget")
    monkeypatch.delenv("AISCHED_TRACEBACK", raising=False)
    one_line(AdmissionDenied, denied, None, lambda t, e, tb: seen.append(t))
    err = capsys.readouterr().err.splitlines()
    assert err == [f"AdmissionDenied: {denied}", "(the whole traceback: AISCHED_TRACEBACK=1)"] and not seen
    assert str(denied).count("Fix:") == 1
    one_line(ValueError, ValueError("x"), None, lambda t, e, tb: seen.append(t))
    monkeypatch.setenv("AISCHED_TRACEBACK", "1")
    one_line(AdmissionDenied, denied, None, lambda t, e, tb: seen.append(t))
    assert seen == [ValueError, AdmissionDenied] and capsys.readouterr().err == ""
    assert sys.excepthook is not None
