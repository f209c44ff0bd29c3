"""Usage and cost reports: the report's figures equal the ledger's posted totals, to the micro-unit and to the cent."""

from __future__ import annotations

import csv
import io
import json
import time
import uuid
from decimal import Decimal

import pytest
from prefect import flow
from prefect.context import FlowRunContext
from typer.testing import CliRunner

from aisched_prefect import Ledger, ai_task, report_usage
from aisched_prefect.cli import app
from aisched_prefect.ledger import MICROS, BudgetLine, to_micros
from aisched_prefect.usage_report import (
    UNKNOWN_FLOW, InvalidReportOption, aggregate, build_report, cents, csv_text, day_key, flow_run_key, json_lines,
    parse_when, usage_rows,
)
from blocks import AuthorityBlock, BudgetBlock, BudgetLimit, Grant
from tests.helpers import runner

cli = CliRunner()


def _posted(ledger: Ledger) -> dict[str, int]:
    """Posted micro-units per account, from the ledger's own API (one period each in these tests)."""
    return {a["budget"]: to_micros(a["posted"]) for a in ledger.accounts()}


def _micros(amount: Decimal | str) -> int:
    micros = Decimal(amount) * MICROS
    assert micros == micros.to_integral_value(), amount
    return int(micros)


# -- the ledger alone, on SQLite and Postgres ---------------------------------------------------
def _run(ledger: Ledger, lines: list[BudgetLine], *, task: str, principal: str, flow_run: str, actual, gpus=1.0,
         seconds=2.0, outcome="completed", gpu_type="H100", lease=None) -> list[str]:
    ids = {"flow_run_id": flow_run, "task_run_id": f"t-{uuid.uuid4().hex[:8]}", "principal": principal}
    payload = {"task": task, "request": {"kind": "inference", "gpus": gpus, "est_seconds": seconds, "gpu_type": gpu_type}}
    held, _ = ledger.reserve(lines, kind="admission", payload=payload, lease_seconds=lease, **ids)
    if actual is not ...:  # ...: leave it pending
        placement = {"gpu_type": gpu_type} if actual is not None else None
        ledger.settle([h.id for h in held], actual, kind="settlement", **ids,
                      payload={**payload, "outcome": outcome, "seconds": seconds, "placement": placement})
    return [h.id for h in held]


def test_report_equals_the_ledger_to_the_micro_unit_with_voided_and_expired_holds(ledger_url):
    ledger = Ledger(ledger_url)
    root = BudgetLine(budget="org", period="2026-11", limit=100, amount=1.0)
    team_a = BudgetLine(budget="org/team-a", period="2026-11", limit=50, amount=1.0)
    team_b = BudgetLine(budget="org/team-b", period="2026-11", limit=50, amount=1.0)
    hours = BudgetLine(budget="org/gpu-hours", period="2026-11", limit=10, amount=2 / 3600, unit="gpu-hours")
    # Charges that do not add up in binary floating point: 0.1 + 0.2, and a third of a cent.
    _run(ledger, [root, team_a, hours], task="a1", principal="team-a/x", flow_run="f1", actual={"org": 0.1, "org/team-a": 0.1, "org/gpu-hours": 2 / 3600})
    _run(ledger, [root, team_a, hours], task="a2", principal="team-a/y", flow_run="f1", actual={"org": 0.2, "org/team-a": 0.2, "org/gpu-hours": 2 / 3600}, gpu_type="A10")
    _run(ledger, [root, team_b], task="b1", principal="team-b/z", flow_run="f2", actual=1 / 300)
    _run(ledger, [root, team_b], task="void", principal="team-b/z", flow_run="f2", actual=None)  # never ran: voided
    _run(ledger, [root, team_b], task="lost", principal="team-b/z", flow_run="f3", actual=..., lease=0.05)
    _run(ledger, [root, team_a], task="running", principal="team-a/x", flow_run="f4", actual=...)  # still held
    time.sleep(0.2)
    assert len(ledger.expire_holds()) == 2  # the lost run's holds: charged in full

    report = build_report(ledger, by="tenant")
    posted = _posted(ledger)
    assert {r.task for r in report.runs} == {"a1", "a2", "b1", "lost"}  # voided and pending runs are not "settled runs"
    assert _micros(report.total.money) == posted["org"] == to_micros(0.1) + to_micros(0.2) + to_micros(1 / 300) + to_micros(1.0)
    groups = {g.key: g for g in report.groups}
    assert _micros(groups["team-a"].money) == posted["org/team-a"] and _micros(groups["team-b"].money) == posted["org/team-b"]
    # b1 ran outside the gpu-hours budget; the lost run is reported at the estimate it held
    assert _micros(report.total.gpu_hours) == posted["org/gpu-hours"] + 2 * to_micros(2 / 3600)
    for b in report.budgets:  # every account: what the report's runs posted on it is what the ledger posted
        assert _micros(b.in_report) == posted[b.budget], b
    assert report.mismatches() == []
    lost = next(r for r in report.runs if r.task == "lost")
    assert lost.outcome == "expired" and lost.money == Decimal("1.000000")
    by_type = {g.key: g for g in aggregate(report.runs, "gpu-type")}
    assert by_type["H100"].runs == 3 and by_type["A10"].runs == 1
    held = next(b for b in report.budgets if b.budget == "org/team-a")
    assert held.held == Decimal("1.000000") and held.remaining == held.limit - held.posted - held.held
    # Filters: one flow run; a window that holds nothing.
    only = build_report(ledger, flow_run_id="f1", by="principal")
    assert [g.key for g in only.groups] == ["team-a/x", "team-a/y"] and only.total.money == Decimal("0.300000")
    assert {b.budget for b in only.budgets} == {"org", "org/team-a", "org/gpu-hours"}  # the budgets it touched
    assert build_report(ledger, since=parse_when("2000-01-01", "--since"), until=parse_when("2000-01-31", "--until", end=True)).runs == []
    today = report.runs[0].settled_at.date().isoformat()
    window = build_report(ledger, since=parse_when(today, "--since"), until=parse_when(today, "--until", end=True))
    assert window.runs == report.runs and window.total == report.total  # read through the window's prefilter


def test_bad_options_name_the_option_and_the_fix(sqlite_url, monkeypatch, tmp_path):
    with pytest.raises(InvalidReportOption, match=r"--by 'team'.*one of tenant, principal, flow, model, gpu-type, day"):
        build_report(Ledger(sqlite_url), by="team")
    with pytest.raises(InvalidReportOption, match=r"--since '31/01/2026': give a date as YYYY-MM-DD"):
        parse_when("31/01/2026", "--since")
    assert parse_when("2026-01-31", "--until", end=True).isoformat() == "2026-02-01T00:00:00+00:00"
    bad_by = cli.invoke(app, ["report", "--ledger", sqlite_url, "--by", "team"])
    assert bad_by.exit_code == 2 and "--by" in bad_by.output and "gpu-type" in bad_by.output
    bad_date = cli.invoke(app, ["report", "--ledger", sqlite_url, "--since", "yesterday"])
    assert bad_date.exit_code == 2 and "--since" in bad_date.output and "YYYY-MM-DD" in bad_date.output
    backwards = cli.invoke(app, ["report", "--ledger", sqlite_url, "--since", "2026-02-01", "--until", "2026-01-01"])
    assert backwards.exit_code == 2 and "--until" in backwards.output
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if the bench extra were not installed
    no_plot = cli.invoke(app, ["report", "--ledger", sqlite_url, "--plot", str(tmp_path / "x.png")])
    assert no_plot.exit_code == 1 and "pip install -e '.[bench]'" in no_plot.output


# -- real flows ----------------------------------------------------------------------------------
PRICES = {"gpu_hour_prices": {"H100": 4.0, "A10": 1.0}, "token_prices_per_1k": {"*": 0.01}}


@pytest.fixture(scope="module")
def two_tenants_ran(prefect_api, gpu_cluster, tmp_path_factory):
    """Two tenants' flows: GPU tasks on H100 and A10, model calls that report tokens (one with a provider cost)."""
    sqlite_url = f"sqlite:///{tmp_path_factory.mktemp('report') / 'ledger.db'}"
    name = f"b-{uuid.uuid4().hex[:8]}"
    BudgetBlock(**PRICES, limit=100, limits=[
        BudgetLimit(name="team-a", scope="tenant", match="team-a", amount=50),
        BudgetLimit(name="team-b", scope="tenant", match="team-b", amount=50),
        BudgetLimit(name="gpu-hours", unit="gpu-hours", amount=10),
        BudgetLimit(name="gpt-tokens", unit="tokens", scope="model", match="gpt-*", amount=100_000),
    ]).save(name)
    auth = AuthorityBlock(grants=[Grant(id=f"{t}-root", principal=f"{t}/*", max_gpus=4, max_cost_per_run=10.0)
                                  for t in ("team-a", "team-b")])

    @ai_task(gpus=1, gpu_type="H100", kind="training", model="llama-8b", est_seconds=5)
    def train_h100():
        time.sleep(0.3)
        return "h100"

    @ai_task(gpus=1, gpu_type="A10", kind="inference", model="llama-8b", est_seconds=5)
    def infer_a10():
        time.sleep(0.2)
        return "a10"

    @ai_task(kind="model-call", model="gpt-x", est_tokens=2000)
    def ask(cost):
        report_usage(input_tokens=120, output_tokens=230, cost=cost)
        return "answer"

    def flow_run_id() -> str:
        return str(FlowRunContext.get().flow_run.id)

    @flow(name="train-nightly", task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, budget=name,
                                                   authority=auth, principal="team-a/nightly"))
    def nightly():
        train_h100(), infer_a10(), ask(None)
        return flow_run_id()

    @flow(name="etl-hourly", task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, budget=name,
                                                authority=auth, principal="team-b/etl"))
    def hourly():
        infer_a10(), ask(0.25)
        return flow_run_id()

    return name, nightly(), hourly(), sqlite_url


def test_report_of_real_flows_matches_the_ledger_and_exports_round_trip(two_tenants_ran, tmp_path):
    name, nightly_run, hourly_run, sqlite_url = two_tenants_ran
    ledger = Ledger(sqlite_url)
    posted = _posted(ledger)
    rows = usage_rows(ledger)
    assert len(rows) == 5 and all(r.outcome == "completed" for r in rows)
    assert {r.gpu_type for r in rows} == {"H100", "A10", None} and {r.tenant for r in rows} == {"team-a", "team-b"}
    # Money per tenant, per principal and in total: the ledger's posted micro-units exactly.
    report = build_report(ledger, by="tenant")
    groups = {g.key: g for g in report.groups}
    assert _micros(groups["team-a"].money) == posted[f"{name}/team-a"] > 0
    assert _micros(groups["team-b"].money) == posted[f"{name}/team-b"] > 0
    assert _micros(report.total.money) == posted[name]
    assert sum(_micros(g.money) for g in aggregate(rows, "principal")) == posted[name]
    assert sum(_micros(g.money) for g in aggregate(rows, "gpu-type")) == posted[name]
    assert sum(_micros(g.money) for g in aggregate(rows, "model")) == posted[name]
    # GPU-hours and tokens that ran are what the gpu-hours and token budgets counted.
    assert _micros(report.total.gpu_hours) == posted[f"{name}/gpu-hours"] > 0
    by_model = {g.key: g for g in aggregate(rows, "model")}
    assert by_model["gpt-x"].tokens * MICROS == posted[f"{name}/gpt-tokens"] == 700 * MICROS
    assert by_model["gpt-x"].runs == 2 and by_model["llama-8b"].runs == 3
    assert all(_micros(b.in_report) == posted[b.budget] for b in report.budgets) and report.mismatches() == []
    by_type = {g.key: g for g in aggregate(rows, "gpu-type")}
    assert by_type["A10"].runs == 2 and by_type["H100"].runs == 1 and by_type["(none)"].gpu_hours == 0

    # The CLI: a table per --by with money to the cent; flow names read from the Prefect API.
    shown = cli.invoke(app, ["report", "--ledger", sqlite_url, "--by", "flow"])
    assert shown.exit_code == 0, shown.output
    assert "train-nightly" in shown.output and "etl-hourly" in shown.output and UNKNOWN_FLOW not in shown.output
    total_line = next(line for line in shown.output.splitlines() if "total" in line)
    assert f"{cents(Decimal(posted[name]) / MICROS):f}" in total_line
    assert f"{name}/team-a" in shown.output and "in report" in shown.output

    # CSV and JSON carry the same exact numbers.
    exported = cli.invoke(app, ["report", "--ledger", sqlite_url, "--csv", "-"])
    assert exported.exit_code == 0
    lines = list(csv.DictReader(io.StringIO(exported.stdout)))
    assert exported.stdout == csv_text(build_report(ledger, flow_names={nightly_run: "train-nightly", hourly_run: "etl-hourly"}).runs)
    assert sum(_micros(r["money"]) for r in lines) == posted[name]
    assert {r["task_run_id"]: _micros(r["money"]) for r in lines} == {r.task_run_id: _micros(r.money) for r in rows}
    as_json = cli.invoke(app, ["report", "--ledger", sqlite_url, "--json", "--by", "principal"])
    assert as_json.exit_code == 0
    records = [json.loads(line) for line in as_json.stdout.splitlines()]
    (total,) = [r for r in records if r["record"] == "total"]
    assert _micros(total["money"]) == posted[name] and total["runs"] == 5 and total["tokens"] == 700
    assert sum(_micros(r["money"]) for r in records if r["record"] == "group") == posted[name]
    assert {r["budget"]: _micros(r["posted"]) for r in records if r["record"] == "budget"} == posted
    assert records[:5] == [{"record": "run", **r} for r in json_lines(build_report(
        ledger, flow_names={nightly_run: "train-nightly", hourly_run: "etl-hourly"}))[:5]]

    # One flow run, and a plot of cumulative spend.
    one = cli.invoke(app, ["report", "--ledger", sqlite_url, "--flow-run", hourly_run, "--by", "model",
                           "--plot", str(tmp_path / "spend.png"), "--csv", str(tmp_path / "runs.csv")])
    assert one.exit_code == 0, one.output
    assert "gpt-x" in one.output and f"{name}/team-a" not in one.output  # only the budgets it touched
    assert (tmp_path / "spend.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((tmp_path / "runs.csv").read_text().splitlines()) == 1 + 2


def test_each_flow_run_publishes_its_usage_artifact_and_the_days(two_tenants_ran):
    from datetime import datetime, timezone

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    name, nightly_run, hourly_run, sqlite_url = two_tenants_ran
    ledger = Ledger(sqlite_url)
    day = day_key(datetime.now(timezone.utc).date())
    with get_client(sync_client=True) as client:
        mine = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[flow_run_key(nightly_run)])))
        days = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[day])))
    (artifact,) = mine
    assert artifact.type == "markdown" and str(artifact.flow_run_id) == nightly_run
    run_money = build_report(ledger, flow_run_id=nightly_run).total.money
    assert "train-nightly" in artifact.data and "train_h100" in artifact.data and "gpt-x" in artifact.data
    assert f"{cents(run_money):f} charged" in artifact.data and f"| {name}/team-a |" in artifact.data
    assert f"{name}/team-b" not in artifact.data  # only the budgets this flow run touched
    assert {str(a.flow_run_id) for a in days} >= {nightly_run, hourly_run}  # each run wrote the day's again
    latest = max(days, key=lambda a: a.created)
    assert "etl-hourly" in latest.data and "train-nightly" in latest.data and "## By tenant" in latest.data


def test_a_report_that_cannot_be_published_never_fails_the_flow(prefect_api, gpu_cluster, sqlite_url, monkeypatch, caplog):
    import aisched_prefect.usage_report as usage_report

    def broken(*_, **__):
        raise RuntimeError("artifact API down")

    monkeypatch.setattr(usage_report, "publish_report_artifacts", broken)

    @ai_task(kind="model-call", model="gpt-x", est_tokens=100)
    def ask():
        report_usage(tokens=50)
        return "answer"

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url))
    def llm():
        return ask()

    with caplog.at_level("ERROR", logger="aisched_prefect"):
        assert llm() == "answer"
    assert "could not publish the usage report artifacts" in caplog.text and "artifact API down" in caplog.text
    assert [r.tokens for r in usage_rows(Ledger(sqlite_url))] == [50]
