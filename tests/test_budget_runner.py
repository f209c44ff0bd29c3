"""Budgets in real flows: scoped limits, top-ups, stops at the cover, reported usage, alerts, leases after SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from prefect import flow

from aisched_prefect import AdmissionDenied, InvalidUsage, Ledger, NoAdmissionContext, ai_task, evidence_rows, report_usage
from aisched_prefect.report import explain
from blocks import BudgetBlock, BudgetLimit
from dask_gpu import checkpoint
from tests.helpers import runner

pytestmark = pytest.mark.usefixtures("prefect_api")
PRICES = {"gpu_hour_prices": {"H100": 4.0, "A10": 1.0}, "token_prices_per_1k": {"*": 0.01}}


def saved(**fields) -> str:
    """Save a BudgetBlock under a fresh name; its accounts in the ledger carry that name."""
    name = f"b-{uuid.uuid4().hex[:8]}"
    BudgetBlock(**{**PRICES, **fields}).save(name)
    return name


def settlement(ledger: Ledger) -> dict:
    return [r for r in ledger.records() if r.kind == "settlement"][-1].payload


def test_flow_and_tenant_limits_nest_under_the_block_limit(gpu_cluster, sqlite_url):
    name = saved(limit=100, limits=[
        BudgetLimit(name="team-a", scope="tenant", match="team-a", amount=1.0),
        BudgetLimit(name="tiny-flow", scope="flow", match="tiny", amount=0.001, parent="team-a"),
    ])

    @ai_task(gpus=1, gpu_type="H100", kind="inference", est_seconds=5)
    def infer():
        time.sleep(0.5)
        return "ok"

    @flow(name="tiny", task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, budget=name))
    def tiny():
        return infer()

    @flow(name="roomy", task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, budget=name))
    def roomy():
        return infer()

    with pytest.raises(AdmissionDenied, match=rf"denied at budget: budget '{name}/tiny-flow' \(.*\) has 0.0010 left"):
        tiny()
    assert roomy() == "ok"
    accounts = {a["budget"]: a for a in Ledger(sqlite_url).accounts()}
    assert accounts[f"{name}/tiny-flow"]["pending"] == accounts[f"{name}/tiny-flow"]["posted"] == 0  # took nothing
    assert accounts[name]["posted"] == accounts[f"{name}/team-a"]["posted"] > 0


def test_a_task_running_past_its_estimate_is_topped_up(gpu_cluster, sqlite_url):
    @ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=1)
    def runs_long():
        time.sleep(2.5)
        return "done"

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, budget=saved(limit=10)))
    def train():
        return runs_long()

    assert train() == "done"
    ledger = Ledger(sqlite_url)
    kinds = [r.kind for r in ledger.records()]
    assert kinds.count("top-up") >= 2 and "top-up-refused" not in kinds
    s = settlement(ledger)
    assert s["outcome"] == "completed" and s["covered_seconds"] >= s["seconds"] >= 2.5
    assert sum(x["charged"] for x in s["settlements"]) == pytest.approx(s["seconds"] / 3600 * 4.0, rel=1e-3)
    (row,) = evidence_rows(ledger.records())
    assert row["reserved"] == pytest.approx((1 + 0.5 * kinds.count("top-up")) / 3600 * 4.0, abs=1e-5)  # each hold rounds to micro-units
    assert "TOPPED UP by 0.5s" in explain(ledger.records())


def test_a_refused_top_up_stops_the_task_at_its_cover_and_charges_what_ran(gpu_cluster, sqlite_url):
    # Two seconds on an H100 cost 0.00222; the budget has room for that, not for one more second.
    name = saved(limit=0.003)

    @ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=2)
    def runs_forever():
        for _ in range(300):
            time.sleep(0.1)
            checkpoint()
        return "finished"

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, budget=name))
    def train():
        return runs_forever()

    with pytest.raises(AdmissionDenied, match=r"denied at budget: the task ran .*a top-up was refused"):
        train()
    ledger = Ledger(sqlite_url)
    assert "TOP-UP REFUSED: budget:" in explain(ledger.records())
    refused = [r for r in ledger.records() if r.kind == "top-up-refused"]
    assert len(refused) == 1 and f"budget '{name}'" in refused[0].payload["reason"]
    s = settlement(ledger)
    assert s["outcome"] == "stopped-budget" and 2.0 <= s["seconds"] < 4.0
    account = ledger.account(name, ledger.accounts()[0]["period"])
    assert account["pending"] == 0 and 0 < account["posted"] <= account["limit"]


def test_reported_usage_is_what_settles(gpu_cluster, sqlite_url):
    name = saved(limit=10, limits=[BudgetLimit(name="gpt-tokens", unit="tokens", scope="model", match="gpt-*", amount=5000)])

    @ai_task(kind="model-call", model="gpt-x", est_tokens=2000)
    def call(cost):
        report_usage(input_tokens=100, output_tokens=200)
        report_usage(input_tokens=100, output_tokens=200, cost=cost)
        return "answer"

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, budget=name))
    def llm():
        return call(None), call(0.5)

    assert llm() == ("answer", "answer")
    ledger = Ledger(sqlite_url)
    first, second = [r.payload for r in ledger.records() if r.kind == "settlement"]
    assert first["usage"]["tokens"] == 600 and first["usage"]["calls"] == 2
    assert first["charges"] == {name: pytest.approx(0.006), f"{name}/gpt-tokens": 600}
    assert second["charges"] == {name: pytest.approx(0.5), f"{name}/gpt-tokens": 600}
    period = ledger.accounts()[0]["period"]
    assert ledger.account(f"{name}/gpt-tokens", period)["posted"] == 1200


def test_report_usage_outside_a_task_or_negative_is_a_clear_error(gpu_cluster, sqlite_url):
    with pytest.raises(NoAdmissionContext, match="inside an @ai_task"):
        report_usage(tokens=1)

    @ai_task(kind="model-call", model="gpt-x", est_tokens=10)
    def bad():
        report_usage(tokens=-5)

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, budget=saved(limit=1)))
    def llm():
        return bad()

    with pytest.raises(InvalidUsage, match=r"report_usage\(tokens=-5\): usage cannot be negative"):
        llm()
    assert settlement(Ledger(sqlite_url))["outcome"] == "failed"


def test_crossing_a_threshold_emits_a_prefect_event(gpu_cluster, sqlite_url):
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter

    name = saved(limit=0.01)  # 5 s on an H100 hold 0.0056: past 50%

    @ai_task(gpus=1, gpu_type="H100", kind="inference", est_seconds=5)
    def infer():
        return "ok"

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, budget=name))
    def spend():
        return infer()

    assert spend() == "ok"
    found = []
    for _ in range(50):  # events are eventually consistent
        with get_client(sync_client=True) as client:
            page = client.read_events(EventFilter(event=EventNameFilter(name=["aisched.budget.threshold-crossed"])), limit=50)
        found = [e for e in page.events if e.resource.id == f"aisched.budget.{name}"]
        if found:
            break
        time.sleep(0.2)
    assert found and found[0].payload["threshold"] == 50 and found[0].resource["aisched.unit"] == "money"


def test_holds_of_a_killed_flow_process_expire_after_their_lease(gpu_cluster, sqlite_url, tmp_path):
    from prefect.settings import PREFECT_API_URL

    started = tmp_path / "started"
    script = tmp_path / "victim.py"
    script.write_text(f'''
import time
from pathlib import Path
from prefect import flow
from aisched_prefect import ai_task
from tests.helpers import runner

@ai_task(gpus=0.25, kind="inference", est_seconds=60)
def work():
    Path({str(started)!r}).write_text("x")
    time.sleep(8)

@flow(task_runner=runner({gpu_cluster.scheduler_address!r}, {sqlite_url!r}, hold_lease_seconds=2))
def victim():
    work()

victim()
''')
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_LOGGING_LEVEL": "ERROR",
           "PYTHONPATH": str(Path(__file__).parent.parent)}
    proc = subprocess.Popen([sys.executable, str(script)], env=env)
    try:
        for _ in range(600):
            if started.exists():
                break
            time.sleep(0.1)
        assert started.exists(), "the victim's task never started"
        time.sleep(2.5)  # long enough for the watcher to renew the lease at least once
        ledger = Ledger(sqlite_url)
        (hold,) = ledger.history()
        assert hold["status"] == "pending" and hold["lease_until"] > hold["created_at"] + 2  # renewed
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert ledger.expire_holds() == []  # the lease has not run out yet
    time.sleep(2.5)
    assert ledger.expire_holds() == [hold["hold"]]
    (after,) = ledger.history()
    assert after["status"] == "expired" and after["charged"] == after["reserved"]  # outcome unknown: charged in full
    assert ledger.verify().ok


def test_a_budget_with_prices_only_admits_and_settles_with_evidence(gpu_cluster, sqlite_url):
    @ai_task(gpus=1, kind="inference", est_seconds=5)
    def infer():
        return "ok"

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, budget=BudgetBlock(gpu_hour_prices={"*": 1.0})))
    def unlimited():
        return infer()

    assert unlimited() == "ok"
    ledger = Ledger(sqlite_url)
    assert [r.kind for r in ledger.records()] == ["admission", "settlement"] and ledger.accounts() == []
    assert settlement(ledger)["outcome"] == "completed"


def test_a_grants_budget_share_caps_what_all_its_runs_hold_together(gpu_cluster, sqlite_url):
    """A delegated grant with budget_share=0.5 may use half of each covering budget, across its runs."""
    from aisched_prefect.grants import delegate_grant
    from tests.helpers import authority

    auth = authority(can_delegate=True)
    name = saved(limit=0.012)  # 5 s on an H100 hold 0.00556: two fit the budget, one fits half of it
    delegate_grant("team-a-root", id="half", principal="team-a/agent", by="alice", authority=auth,
                   ledger=Ledger(sqlite_url), budget_share=0.5)

    @ai_task(gpus=1, gpu_type="H100", kind="inference", est_seconds=5)
    def infer():
        time.sleep(1.0)
        return "ok"

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, budget=name, authority=auth,
                             principal="team-a/agent", grant="half", max_workers=4))
    def agent():
        out = []
        for f in [infer.submit() for _ in range(2)]:
            try:
                out.append(f.result())
            except AdmissionDenied as exc:
                out.append(str(exc))
        return out

    out = agent()
    assert out.count("ok") == 1
    assert any(f"budget '{name}#half'" in o for o in out)  # the grant's own half, not the whole budget
    ledger = Ledger(sqlite_url)
    accounts = {a["budget"]: a for a in ledger.accounts()}
    assert accounts[f"{name}#half"]["limit"] == pytest.approx(0.006)
    assert accounts[f"{name}#half"]["posted"] == accounts[name]["posted"] > 0  # charged on both, the same
