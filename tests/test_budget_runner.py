"""Budgets in real flows, settled by the control plane: scoped limits, top-ups, stops at the cover, reported usage,
alerts, and what becomes of holds when the flow process or the control plane itself is killed."""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from prefect import flow
from prefect.context import FlowRunContext

from aisched_prefect import AdmissionDenied, InvalidUsage, NoAdmissionContext, ai_task, evidence_rows, report_usage
from aisched_prefect.reports.runs import explain
from blocks import BudgetBlock, BudgetLimit
from dask_gpu import checkpoint
from tests.helpers import authority, tenant

pytestmark = pytest.mark.usefixtures("prefect_api")
PRICES = {"gpu_hour_prices": {"H100": 4.0, "A10": 1.0}, "token_prices_per_1k": {"*": 0.01}}
REPO = Path(__file__).parent.parent


def budget_of(**fields) -> BudgetBlock:
    return BudgetBlock(**{**PRICES, **fields})


def flow_run_id() -> str:
    return str(FlowRunContext.get().flow_run.id)


def settlements(plane, run: str) -> list[dict]:
    return [r.payload for r in plane.records(run) if r.kind == "settlement"]


def accounts(plane, name: str) -> dict[str, dict]:
    """This test's accounts in the shared ledger: `<budget>`, `<budget>/<limit>` and `<budget>#<grant>`."""
    return {a["budget"]: a for a in plane.ledger().accounts()
            if a["budget"] == name or a["budget"].startswith((f"{name}/", f"{name}#"))}


def holds_of(plane, run: str) -> list[dict]:
    return [h for h in plane.ledger().history(limit=100_000) if h["flow_run_id"] == run]


def test_flow_and_tenant_limits_nest_under_the_block_limit(control_plane):
    t = tenant(control_plane, budget_=budget_of(limit=100, limits=[
        BudgetLimit(name="team-a", scope="tenant", match="team-a", amount=1.0),
        BudgetLimit(name="tiny-flow", scope="flow", match="tiny", amount=0.001, parent="team-a"),
    ]))

    @ai_task(gpus=1, gpu_type="H100", kind="inference", est_seconds=5)
    def infer():
        time.sleep(0.5)
        return "ok"

    @flow(name="tiny", task_runner=t.runner())
    def tiny():
        return infer()

    @flow(name="roomy", task_runner=t.runner())
    def roomy():
        return infer()

    name = t.budget
    with pytest.raises(AdmissionDenied, match=rf"denied at budget: budget '{name}/tiny-flow' \(.*\) has 0.0010 left"):
        tiny()
    assert roomy() == "ok"
    got = accounts(control_plane, name)
    assert f"{name}/tiny-flow" not in got  # refused: it took nothing, and left no account behind
    assert got[name]["posted"] == got[f"{name}/team-a"]["posted"] > 0
    assert got[name]["pending"] == got[f"{name}/team-a"]["pending"] == 0


def test_a_task_running_past_its_estimate_is_topped_up(control_plane):
    t = tenant(control_plane, budget_=budget_of(limit=10))

    @ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=1)
    def runs_long():
        time.sleep(2.5)
        return "done"

    @flow(task_runner=t.runner())
    def train():
        return runs_long(), flow_run_id()

    out, run = train()
    assert out == "done"
    records = control_plane.records(run)
    kinds = [r.kind for r in records]
    assert kinds.count("top-up") >= 2 and "top-up-refused" not in kinds
    (s,) = settlements(control_plane, run)
    assert s["outcome"] == "completed" and s["covered_seconds"] >= s["seconds"] >= 2.5
    assert s["top_ups"] == kinds.count("top-up")
    assert sum(x["charged"] for x in s["settlements"]) == pytest.approx(s["seconds"] / 3600 * 4.0, rel=1e-3)
    (row,) = evidence_rows(records)
    assert row["reserved"] == pytest.approx((1 + 0.5 * kinds.count("top-up")) / 3600 * 4.0, abs=1e-5)  # each hold rounds to micro-units
    assert "TOPPED UP by 0.5s" in explain(records)
    assert all(h["status"] != "pending" for h in holds_of(control_plane, run))


def test_a_refused_top_up_stops_the_task_at_its_cover_and_charges_what_ran(control_plane):
    # Two seconds on an H100 cost 0.00222; the budget has room for that, not for one more second.
    t = tenant(control_plane, budget_=budget_of(limit=0.003))
    name = t.budget

    @ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=2)
    def runs_forever():
        for _ in range(300):
            time.sleep(0.1)
            checkpoint()
        return "finished"

    runs: list[str] = []

    @flow(task_runner=t.runner())
    def train():
        runs.append(flow_run_id())
        return runs_forever()

    with pytest.raises(AdmissionDenied, match=r"denied at budget: the task ran .*a top-up was refused"):
        train()
    records = control_plane.records(runs[0])
    assert "TOP-UP REFUSED: budget:" in explain(records)
    refused = [r for r in records if r.kind == "top-up-refused"]
    assert len(refused) == 1 and f"budget '{name}'" in refused[0].payload["reason"]
    (s,) = settlements(control_plane, runs[0])
    assert s["outcome"] == "stopped-budget" and 2.0 <= s["seconds"] < 4.0
    assert sum(x["charged"] for x in s["settlements"]) == pytest.approx(s["seconds"] / 3600 * 4.0, rel=1e-3)
    account = accounts(control_plane, name)[name]
    assert account["pending"] == 0 and 0 < account["posted"] <= account["limit"]


def test_reported_usage_is_what_settles(control_plane):
    t = tenant(control_plane, budget_=budget_of(limit=10, limits=[
        BudgetLimit(name="gpt-tokens", unit="tokens", scope="model", match="gpt-*", amount=5000)]))
    name = t.budget

    @ai_task(kind="model-call", model="gpt-x", est_tokens=2000)
    def call(cost):
        report_usage(input_tokens=100, output_tokens=200)
        report_usage(input_tokens=100, output_tokens=200, cost=cost)
        return "answer"

    @flow(task_runner=t.runner())
    def llm():
        return call(None), call(0.5), flow_run_id()

    *answers, run = llm()
    assert answers == ["answer", "answer"]
    first, second = settlements(control_plane, run)
    assert first["usage"]["tokens"] == 600 and first["usage"]["calls"] == 2
    assert first["usage"]["input_tokens"] == 200 and first["usage"]["output_tokens"] == 400
    assert first["charges"] == {name: pytest.approx(0.006), f"{name}/gpt-tokens": 600}
    assert second["charges"] == {name: pytest.approx(0.5), f"{name}/gpt-tokens": 600}
    got = accounts(control_plane, name)
    assert got[f"{name}/gpt-tokens"]["posted"] == 1200 and got[f"{name}/gpt-tokens"]["pending"] == 0
    assert got[name]["posted"] == pytest.approx(0.506)


def test_report_usage_outside_a_task_negative_or_not_finite_is_a_clear_error(control_plane):
    with pytest.raises(NoAdmissionContext, match="inside an @ai_task"):
        report_usage(tokens=1)
    for bad in ({"tokens": -5}, {"cost": math.nan}, {"cost": math.inf}, {"input_tokens": -1}):
        (field, value), = bad.items()
        with pytest.raises(InvalidUsage, match=rf"report_usage\({field}={value!r}\): usage must be a finite number"):
            report_usage(**bad)  # checked before it looks for a task: the same error inside one

    t = tenant(control_plane, budget_=budget_of(limit=1))
    runs: list[str] = []

    @ai_task(kind="model-call", model="gpt-x", est_tokens=10)
    def bad(kw):
        report_usage(**kw)

    @flow(task_runner=t.runner())
    def llm(kw):
        runs.append(flow_run_id())
        return bad(kw)

    with pytest.raises(InvalidUsage, match=r"report_usage\(tokens=-5\): usage must be a finite number from 0"):
        llm({"tokens": -5})
    with pytest.raises(InvalidUsage, match=r"report_usage\(cost=nan\): usage must be a finite number"):
        llm({"cost": math.nan})
    for run in runs:
        (s,) = settlements(control_plane, run)
        assert s["outcome"] == "failed" and "InvalidUsage" in s["error"]
    assert accounts(control_plane, t.budget)[t.budget]["pending"] == 0


def test_a_body_that_reports_around_report_usage_is_checked_again_by_the_control_plane(control_plane):
    """A body can send anything through the report channel; the control plane settles it anyway, never on its word."""
    t = tenant(control_plane, budget_=budget_of(limit=1))
    runs: list[str] = []

    @ai_task(kind="model-call", model="gpt-x", est_tokens=1000)
    def liar(report):
        from dask_gpu.body.child import report as send

        send({"usage": report})
        return "free lunch"

    @flow(task_runner=t.runner())
    def llm(report):
        runs.append(flow_run_id())
        return liar(report)

    for lie in ({"tokens": -1_000_000}, {"cost": -5.0}, {"tokens": "lots"}, {"cost": 1e300}):
        with pytest.raises(InvalidUsage, match="invalid usage report"):
            llm(lie)
    for run in runs:
        (s,) = settlements(control_plane, run)
        # charged what it held: the estimate (1000 tokens at 0.01 / 1k), never a negative or absurd figure
        assert s["outcome"] == "failed" and "invalid usage report" in s["error"]
        assert s["charges"] == {t.budget: pytest.approx(0.01)}
    account = accounts(control_plane, t.budget)[t.budget]
    assert account["pending"] == 0 and account["posted"] == pytest.approx(0.04)


def test_crossing_a_threshold_emits_a_prefect_event(control_plane):
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter

    t = tenant(control_plane, budget_=budget_of(limit=0.01))  # 5 s on an H100 hold 0.0056: past 50%
    name = t.budget

    @ai_task(gpus=1, gpu_type="H100", kind="inference", est_seconds=5)
    def infer():
        return "ok"

    @flow(task_runner=t.runner())
    def spend():
        return infer()

    assert spend() == "ok"
    found = []
    for _ in range(100):  # events are eventually consistent
        with get_client(sync_client=True) as client:
            page = client.read_events(EventFilter(event=EventNameFilter(name=["aisched.budget.threshold-crossed"])), limit=50)
        found = [e for e in page.events if e.resource.id == f"aisched.budget.{name}"]
        if found:
            break
        time.sleep(0.2)
    assert found and found[0].payload["threshold"] == 50 and found[0].resource["aisched.unit"] == "money"
    assert found[0].payload["budget"] == name and found[0].payload["limit"] == pytest.approx(0.01)


def _victim(tmp_path: Path, plane_url: str, token: str, started: Path, seconds: float) -> subprocess.Popen:
    """A flow in its own process whose one AI task touches `started` and sleeps `seconds`."""
    from prefect.settings import PREFECT_API_URL

    script = tmp_path / f"victim-{uuid.uuid4().hex[:6]}.py"
    script.write_text(f'''
import time
from pathlib import Path
from prefect import flow
from aisched_prefect import AISchedTaskRunner, ai_task

@ai_task(gpus=0.25, kind="inference", est_seconds=60)
def work():
    Path({str(started)!r}).write_text("x")
    time.sleep({seconds!r})
    return "done"

@flow(task_runner=AISchedTaskRunner(control_plane={plane_url!r}, credential={token!r}))
def victim():
    work()

victim()
''')
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_LOGGING_LEVEL": "ERROR",
           "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and not path.exists() and proc.poll() is None:
        time.sleep(0.1)
    assert path.exists(), f"the victim's task never started (exit code {proc.poll()})"


def test_killing_the_flow_process_strands_no_hold_the_control_plane_settles_the_run(control_plane, tmp_path):
    """The flow process is only a client: killed mid-run, its task still ends, and the control plane settles it
    for what ran (not the hold, not never)."""
    t = tenant(control_plane)
    started = tmp_path / "started"
    proc = _victim(tmp_path, control_plane.url, t.token, started, seconds=3)
    try:
        _wait_for(started, proc)
        (hold,) = [h for h in control_plane.ledger().history(t.budget, limit=100)]
        assert hold["status"] == "pending"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    deadline = time.time() + 30
    while time.time() < deadline and control_plane.ledger().history(t.budget, limit=100)[0]["status"] == "pending":
        time.sleep(0.2)
    (after,) = control_plane.ledger().history(t.budget, limit=100)
    assert after["status"] == "posted", after
    # 0.25 GPU x ~3 s x 4.0/h: what ran, far below the 60 s it held
    assert 0 < after["charged"] < after["reserved"] / 5
    (s,) = settlements(control_plane, hold["flow_run_id"])
    assert s["outcome"] == "completed" and 3.0 <= s["seconds"] < 10


def test_holds_of_a_killed_control_plane_expire_after_their_lease(gpu_cluster, plane_home, tmp_path):
    """A control plane killed mid-run renews nothing: its holds' leases run out and they expire, charged in full."""
    from tests.controlplane import ControlPlaneProcess

    home = tmp_path / "plane"
    home.mkdir()
    shutil.copy(plane_home / "control.key", home / "control.key")  # the key the session's workers trust
    plane = ControlPlaneProcess(home, dask_address=gpu_cluster.scheduler_address, dask_tls=plane_home / "tls", env={
        "AISCHED_HOLD_LEASE_SECONDS": "2", "AISCHED_BODY_LEASE_SECONDS": "3"}).start()
    started = tmp_path / "started"
    proc = None
    try:
        t = tenant(plane)
        proc = _victim(tmp_path, plane.url, t.token, started, seconds=20)
        _wait_for(started, proc)
        time.sleep(2.5)  # long enough for the watcher to renew the lease at least once
        ledger = plane.ledger()
        (hold,) = ledger.history()
        assert hold["status"] == "pending" and hold["lease_until"] > hold["created_at"] + 2  # renewed
        plane.kill()
        assert ledger.expire_holds() == []  # the lease has not run out yet
        time.sleep(2.5)
        assert ledger.expire_holds() == [hold["hold"]]
        (after,) = ledger.history()
        assert after["status"] == "expired" and after["charged"] == after["reserved"]  # outcome unknown: charged in full
        assert ledger.verify().ok
        from aisched_prefect.reports.usage import usage_rows

        (row,) = usage_rows(ledger)  # reported as what it held, with the request it was admitted for
        assert (row.outcome, row.gpus, row.kind, row.seconds) == ("expired", 0.25, "inference", None)
        assert float(row.money) == pytest.approx(after["charged"], abs=1e-6)
        assert float(row.gpu_hours) == pytest.approx(0.25 * 60 / 3600, abs=1e-6)  # to the micro-unit
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(timeout=30)
        plane.stop()


def test_a_budget_with_prices_only_admits_and_settles_with_evidence(control_plane):
    t = tenant(control_plane, budget_=BudgetBlock(gpu_hour_prices={"*": 1.0}))

    @ai_task(gpus=1, kind="inference", est_seconds=5)
    def infer():
        return "ok"

    @flow(task_runner=t.runner())
    def unlimited():
        return infer(), flow_run_id()

    out, run = unlimited()
    assert out == "ok"
    assert [r.kind for r in control_plane.records(run)] == ["admission", "settlement"]
    assert accounts(control_plane, t.budget) == {} and holds_of(control_plane, run) == []
    (s,) = settlements(control_plane, run)
    assert s["outcome"] == "completed"


def test_a_grants_budget_share_caps_what_all_its_runs_hold_together(control_plane):
    """A delegated grant with budget_share=0.5 may use half of each covering budget, across its runs."""
    t = tenant(control_plane, authority_=authority(can_delegate=True),
               budget_=budget_of(limit=0.012))  # 5 s on an H100 hold 0.00556: two fit the budget, one fits half of it
    name, half = t.budget, f"half-{uuid.uuid4().hex[:6]}"
    resp = control_plane.delegate("team-a-root", token=t.token, id=half, principal="team-a/agent", budget_share=0.5)
    assert resp.status_code == 200, resp.text
    agent = control_plane.issue("team-a/agent", authority=t.authority, budget=name, tenant="team-a")

    @ai_task(gpus=1, gpu_type="H100", kind="inference", est_seconds=5)
    def infer():
        time.sleep(1.0)
        return "ok"

    from aisched_prefect import AISchedTaskRunner

    @flow(task_runner=AISchedTaskRunner(control_plane=control_plane.url, credential=agent, grant=half, max_workers=4))
    def run_as_agent():
        out = []
        for f in [infer.submit() for _ in range(2)]:
            try:
                out.append(f.result())
            except AdmissionDenied as exc:
                out.append(str(exc))
        return out

    out = run_as_agent()
    assert out.count("ok") == 1
    assert any(f"budget '{name}#{half}'" in o for o in out), out  # the grant's own half, not the whole budget
    got = accounts(control_plane, name)
    assert got[f"{name}#{half}"]["limit"] == pytest.approx(0.006)
    assert got[f"{name}#{half}"]["posted"] == got[name]["posted"] > 0  # charged on both, the same
    assert got[f"{name}#{half}"]["pending"] == got[name]["pending"] == 0


def test_a_run_being_settled_takes_no_top_up():
    """The watcher's top-up and the run's settlement exclude each other: a hold taken after the settlement read
    the run's holds would stay pending, then expire charged in full for time that never ran."""
    from aisched_prefect.control.dispatch.running import Running

    r = Running(admission=None, key="k", holds=[], covered_seconds=1.0, submitted=0.0)  # type: ignore[arg-type]
    reserved: list[str] = []
    assert r.add_holds(lambda: reserved.append("first") or ["hold-1"]) and r.holds == ["hold-1"]
    with r.holds_lock:  # what Dispatcher.settle does before it reads the holds
        r.settled = True
    assert not r.add_holds(lambda: reserved.append("second") or ["hold-2"])
    assert reserved == ["first"] and r.holds == ["hold-1"]  # nothing was reserved once it was settling
