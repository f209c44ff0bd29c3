"""Usage and cost reports: the report's figures equal the ledger's posted totals, to the micro-unit and to the cent."""

from __future__ import annotations

import csv
import io
import json
import shutil
import time
import uuid
from decimal import Decimal

import pytest
from prefect import flow
from prefect.context import FlowRunContext

from aisched_prefect import AISchedTaskRunner, Ledger, ai_task, report_usage
from aisched_prefect.ledger import MICROS, BudgetLine, to_micros
from aisched_prefect.reports.usage import (
    UNKNOWN_FLOW, InvalidReportOption, PlotUnavailable, aggregate, budget_table, build_report, cents, csv_text,
    day_key, flow_run_key, group_table, json_lines, name_flows, parse_when, plot_spend, prefect_flow_names, usage_rows,
)
from blocks import AuthorityBlock, BudgetBlock, BudgetLimit, Grant



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


def test_gpu_hours_equal_what_the_gpu_hours_budget_posted_where_rounding_carries(ledger_url):
    """Runs of 1.5 micro-GPU-hours each: the ledger posts the true sum (it carries each account's rounding remainder),
    and so must the report, run by run, rather than round each run's hours on its own."""
    ledger = Ledger(ledger_url)
    seconds = 0.0054  # 1 GPU for 5.4 ms = 1.5e-6 GPU-hours: half a micro-unit to carry
    actual = seconds / 3600
    for i in range(5):
        lines = [BudgetLine(budget="org", period="2026-11", limit=100, amount=0.01),
                 BudgetLine(budget="org/gpu-hours", period="2026-11", limit=10, amount=actual, unit="gpu-hours")]
        _run(ledger, lines, task=f"r{i}", principal="team-a/x", flow_run="f1", seconds=seconds,
             actual={"org": 0.01, "org/gpu-hours": actual})
    posted = _posted(ledger)["org/gpu-hours"]
    assert posted != 5 * to_micros(actual), "precondition: rounding each run on its own differs from the books"
    report = build_report(ledger, by="tenant")
    assert _micros(report.total.gpu_hours) == posted
    charged = {r.task: sum(c.micros for c in r.charges if c.budget == "org/gpu-hours") for r in report.runs}
    assert {r.task: _micros(r.gpu_hours) for r in report.runs} == charged
    assert next(b for b in report.budgets if b.budget == "org/gpu-hours").in_report == report.total.gpu_hours
    assert report.mismatches() == []


def test_bad_options_name_the_option_and_the_fix(sqlite_url, monkeypatch, tmp_path):
    with pytest.raises(InvalidReportOption, match=r"--by 'team'.*one of tenant, principal, flow, model, gpu-type, kind, day"):
        build_report(Ledger(sqlite_url), by="team")
    with pytest.raises(InvalidReportOption, match=r"--since '31/01/2026': give a date as YYYY-MM-DD"):
        parse_when("31/01/2026", "--since")
    with pytest.raises(InvalidReportOption, match=r"--since 'yesterday': give a date as YYYY-MM-DD"):
        parse_when("yesterday", "--since")
    assert parse_when("2026-01-31", "--until", end=True).isoformat() == "2026-02-01T00:00:00+00:00"
    with pytest.raises(InvalidReportOption, match=r"--since '2026-02-01T00:00:00\+00:00': must be before --until"):
        build_report(Ledger(sqlite_url), since=parse_when("2026-02-01", "--since"), until=parse_when("2026-01-01", "--until"))
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if the report extra were not installed
    with pytest.raises(PlotUnavailable, match=r"pip install '\.\[report\]'"):
        plot_spend([], "tenant", str(tmp_path / "x.png"))


def test_cli_bad_options_name_the_option_and_the_fix(sqlite_url, monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from aisched_prefect.cli import app

    cli = CliRunner()
    bad_by = cli.invoke(app, ["report", "--ledger", sqlite_url, "--by", "team"])
    assert bad_by.exit_code == 2 and "--by" in bad_by.output and "gpu-type" in bad_by.output
    bad_date = cli.invoke(app, ["report", "--ledger", sqlite_url, "--since", "yesterday"])
    assert bad_date.exit_code == 2 and "--since" in bad_date.output and "YYYY-MM-DD" in bad_date.output
    backwards = cli.invoke(app, ["report", "--ledger", sqlite_url, "--since", "2026-02-01", "--until", "2026-01-01"])
    assert backwards.exit_code == 2 and "--until" in backwards.output
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if the report extra were not installed
    no_plot = cli.invoke(app, ["report", "--ledger", sqlite_url, "--plot", str(tmp_path / "x.png")])
    assert no_plot.exit_code == 1 and "pip install '.[report]'" in no_plot.output


def test_a_run_settled_twice_counts_both_and_an_expired_run_counts_its_top_ups(sqlite_url):
    """A preempted run is charged, admitted again and settled at its end under one task run; a run whose control
    plane died after top-ups expires holding its estimate and every top-up. The report counts what was charged."""
    ledger = Ledger(sqlite_url)
    money = lambda x: BudgetLine(budget="org", period="2026-11", limit=100, amount=x)  # noqa: E731
    hours = lambda x: BudgetLine(budget="org/gpu-hours", period="2026-11", limit=10, amount=x, unit="gpu-hours")  # noqa: E731
    tokens = lambda x: BudgetLine(budget="org/tokens", period="2026-11", limit=1e6, amount=x, unit="tokens")  # noqa: E731
    req = {"kind": "training", "gpus": 2, "est_seconds": 10, "gpu_type": "H100", "model": "llama", "est_tokens": 50}
    ids = {"flow_run_id": "f1", "task_run_id": "preempted", "principal": "team-a/x"}
    for outcome, seconds, used in (("stopped-preempted", 3.3, 7), ("completed", 4.4, 11)):
        held, _ = ledger.reserve([money(0.02), hours(2 * 10 / 3600), tokens(50)], kind="admission",
                                 payload={"task": "t", "request": req}, **ids)
        ledger.settle([h.id for h in held], {"org": seconds / 1000, "org/gpu-hours": 2 * seconds / 3600, "org/tokens": used},
                      kind="settlement", **ids, payload={"task": "t", "request": req, "outcome": outcome,
                                                         "seconds": seconds, "usage": {"tokens": used},
                                                         "placement": {"gpu_type": "H100"}})
    lost = {"flow_run_id": "f1", "task_run_id": "lost", "principal": "team-a/x"}
    held, _ = ledger.reserve([money(0.02), hours(2 * 10 / 3600)], kind="admission", lease_seconds=0.05,
                             payload={"task": "t", "request": req}, **lost)
    for extra in (5.0, 5.0):
        ledger.reserve([money(0.01), hours(2 * extra / 3600)], kind="top-up", lease_seconds=0.05,
                       payload={"task": "t", "top_up": {"seconds": extra}}, **lost)
    time.sleep(0.2)
    assert len(ledger.expire_holds()) == 6
    report = build_report(ledger, by="tenant")
    posted = _posted(ledger)
    assert report.mismatches() == []
    runs = {r.task_run_id: r for r in report.runs}
    assert runs["preempted"].seconds == pytest.approx(7.7) and runs["preempted"].tokens == 18
    assert runs["preempted"].outcome == "completed"
    assert runs["lost"].outcome == "expired" and runs["lost"].seconds is None
    # the expired run is reported with its admission's request, not a top-up's (which carries none)
    assert (runs["lost"].gpus, runs["lost"].kind, runs["lost"].model) == (2.0, "training", "llama")
    assert runs["lost"].gpu_hours == Decimal(to_micros(2 * 10 / 3600) + 2 * to_micros(2 * 5 / 3600)) / MICROS
    assert _micros(report.total.gpu_hours) == posted["org/gpu-hours"]
    assert report.total.tokens * MICROS == posted["org/tokens"] + 50 * MICROS  # the lost run: its estimate, uncharged
    assert _micros(report.total.money) == posted["org"]


# -- real flows, on a control plane of their own (its ledger holds only these runs) ---------------------------
PRICES = {"gpu_hour_prices": {"H100": 4.0, "A10": 1.0}, "token_prices_per_1k": {"*": 0.01}}


def _own_plane(tmp_path_factory, gpu_cluster, plane_home, name: str, **env: str):
    from tests.controlplane import ControlPlaneProcess

    home = tmp_path_factory.mktemp(name)
    shutil.copy(plane_home / "control.key", home / "control.key")  # the key the session's workers trust
    plane = ControlPlaneProcess(home, dask_address=gpu_cluster.scheduler_address, dask_tls=plane_home / "tls")
    plane.env.update(env)
    return plane.start()


@pytest.fixture(scope="module")
def two_tenants_ran(prefect_api, gpu_cluster, plane_home, tmp_path_factory):
    """Two tenants' flows: GPU tasks on H100 and A10, model calls that report tokens (one with a provider cost)."""
    plane = _own_plane(tmp_path_factory, gpu_cluster, plane_home, "report-plane", AISCHED_DAY_REPORT_SECONDS="1")
    name = "org"
    plane.apply("budget", name, BudgetBlock(**PRICES, limit=100, limits=[
        BudgetLimit(name="team-a", scope="tenant", match="team-a", amount=50),
        BudgetLimit(name="team-b", scope="tenant", match="team-b", amount=50),
        BudgetLimit(name="gpu-hours", unit="gpu-hours", amount=10),
        BudgetLimit(name="gpt-tokens", unit="tokens", scope="model", match="gpt-*", amount=100_000),
    ]))
    principals = {"team-a": "team-a/nightly", "team-b": "team-b/etl"}
    plane.apply("authority", name, AuthorityBlock(grants=[
        Grant(id=f"{t}-root", principal=p, max_gpus=4, max_cost_per_run=10.0) for t, p in principals.items()]))
    tokens = {t: plane.issue(p, authority=name, budget=name, tenant=t) for t, p in principals.items()}

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

    @flow(name="train-nightly", task_runner=AISchedTaskRunner(control_plane=plane.url, credential=tokens["team-a"]))
    def nightly():
        train_h100(), infer_a10(), ask(None)
        return flow_run_id()

    @flow(name="etl-hourly", task_runner=AISchedTaskRunner(control_plane=plane.url, credential=tokens["team-b"]))
    def hourly():
        infer_a10(), ask(0.25)
        return flow_run_id()

    try:
        yield name, nightly(), hourly(), plane
    finally:
        plane.stop()


def test_report_of_real_flows_matches_the_ledger_and_exports_round_trip(two_tenants_ran, tmp_path):
    name, nightly_run, hourly_run, plane = two_tenants_ran
    ledger = plane.ledger()
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

    # By flow: the control plane's settlements name their flow; Prefect names the rest (asked once).
    by_flow = build_report(ledger, by="flow", flow_lookup=lambda ids: pytest.fail(f"asked Prefect for {ids}"))
    assert {g.key for g in by_flow.groups} == {"train-nightly", "etl-hourly"}
    unnamed = [r.model_copy(update={"flow": UNKNOWN_FLOW}) for r in rows]
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        named = name_flows(unnamed, lambda ids: prefect_flow_names(client, ids))
    assert [r.flow for r in named] == [r.flow for r in rows]
    # The table people read: money to the cent, the total last; every budget with what the report's runs posted.
    table = group_table(by_flow)
    assert table[-1]["flow"] == "total" and table[-1]["money"] == f"{cents(Decimal(posted[name]) / MICROS):f}"
    budgets = {b["budget"]: b for b in budget_table(report.budgets)}
    assert budgets[f"{name}/team-a"]["in report"] == budgets[f"{name}/team-a"]["posted"]

    # CSV and JSON carry the same exact numbers.
    names = {nightly_run: "train-nightly", hourly_run: "etl-hourly"}
    text = csv_text(build_report(ledger, flow_names=names).runs)
    lines = list(csv.DictReader(io.StringIO(text)))
    assert sum(_micros(r["money"]) for r in lines) == posted[name]
    assert {r["task_run_id"]: _micros(r["money"]) for r in lines} == {r.task_run_id: _micros(r.money) for r in rows}
    records = json.loads(json.dumps(json_lines(build_report(ledger, by="principal", flow_names=names))))
    (total,) = [r for r in records if r["record"] == "total"]
    assert _micros(total["money"]) == posted[name] and total["runs"] == 5 and total["tokens"] == 700
    assert sum(_micros(r["money"]) for r in records if r["record"] == "group") == posted[name]
    assert {r["budget"]: _micros(r["posted"]) for r in records if r["record"] == "budget"} == posted
    assert [r for r in records if r["record"] == "run"] == [{"record": "run", **r.flat()} for r in rows]

    # One flow run, and a plot of cumulative spend.
    one = build_report(ledger, flow_run_id=hourly_run, by="model")
    assert {g.key for g in one.groups} == {"gpt-x", "llama-8b"} and len(one.runs) == 2
    assert f"{name}/team-a" not in {b.budget for b in one.budgets}  # only the budgets it touched
    plot_spend(one.runs, "model", str(tmp_path / "spend.png"))
    assert (tmp_path / "spend.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_report_of_real_flows_shows_exports_and_plots(two_tenants_ran, tmp_path):
    from typer.testing import CliRunner

    from aisched_prefect.cli import app

    cli = CliRunner()
    name, nightly_run, hourly_run, plane = two_tenants_ran
    ledger, url = plane.ledger(), plane.ledger_url
    posted = _posted(ledger)
    rows = usage_rows(ledger)
    # The CLI: a table per --by with money to the cent; flow names read from the Prefect API.
    shown = cli.invoke(app, ["report", "--ledger", url, "--by", "flow"])
    assert shown.exit_code == 0, shown.output
    assert "train-nightly" in shown.output and "etl-hourly" in shown.output and UNKNOWN_FLOW not in shown.output
    total_line = next(line for line in shown.output.splitlines() if "total" in line)
    assert f"{cents(Decimal(posted[name]) / MICROS):f}" in total_line
    assert f"{name}/team-a" in shown.output and "in report" in shown.output
    # CSV and JSON carry the same exact numbers.
    exported = cli.invoke(app, ["report", "--ledger", url, "--csv", "-"])
    assert exported.exit_code == 0
    lines = list(csv.DictReader(io.StringIO(exported.stdout)))
    assert exported.stdout == csv_text(build_report(ledger, flow_names={nightly_run: "train-nightly", hourly_run: "etl-hourly"}).runs)
    assert sum(_micros(r["money"]) for r in lines) == posted[name]
    assert {r["task_run_id"]: _micros(r["money"]) for r in lines} == {r.task_run_id: _micros(r.money) for r in rows}
    as_json = cli.invoke(app, ["report", "--ledger", url, "--json", "--by", "principal"])
    assert as_json.exit_code == 0
    records = [json.loads(line) for line in as_json.stdout.splitlines()]
    (total,) = [r for r in records if r["record"] == "total"]
    assert _micros(total["money"]) == posted[name] and total["runs"] == 5 and total["tokens"] == 700
    assert sum(_micros(r["money"]) for r in records if r["record"] == "group") == posted[name]
    assert {r["budget"]: _micros(r["posted"]) for r in records if r["record"] == "budget"} == posted
    assert records[:5] == [{"record": "run", **r} for r in json_lines(build_report(
        ledger, flow_names={nightly_run: "train-nightly", hourly_run: "etl-hourly"}))[:5]]
    # One flow run, and a plot of cumulative spend.
    one = cli.invoke(app, ["report", "--ledger", url, "--flow-run", hourly_run, "--by", "model",
                           "--plot", str(tmp_path / "spend.png"), "--csv", str(tmp_path / "runs.csv")])
    assert one.exit_code == 0, one.output
    assert "gpt-x" in one.output and f"{name}/team-a" not in one.output  # only the budgets it touched
    assert (tmp_path / "spend.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((tmp_path / "runs.csv").read_text().splitlines()) == 1 + 2


def test_each_flow_run_publishes_its_usage_artifact_and_the_days(two_tenants_ran):
    """The control plane (which holds the ledger) publishes a flow run's when its runner closes, and the day's on a
    schedule (it reads the whole day: a flow run's end never waits for it)."""
    from datetime import datetime, timezone

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    name, nightly_run, hourly_run, plane = two_tenants_ran
    ledger = plane.ledger()
    day = day_key(datetime.now(timezone.utc).date())
    deadline = time.time() + 60
    with get_client(sync_client=True) as client:
        mine = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[flow_run_key(nightly_run)])))
        while True:  # the day's is rebuilt every second on this control plane, once the runs settled
            days = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[day])))
            latest = max(days, key=lambda a: a.created) if days else None
            if latest is not None and "etl-hourly" in latest.data and "train-nightly" in latest.data:
                break
            assert time.time() < deadline, "the day's usage artifact was not published"
            time.sleep(0.5)
    (artifact,) = mine
    assert artifact.type == "markdown" and str(artifact.flow_run_id) == nightly_run
    run_money = build_report(ledger, flow_run_id=nightly_run).total.money
    assert "train-nightly" in artifact.data and "train_h100" in artifact.data and "gpt-x" in artifact.data
    assert f"{cents(run_money):f} charged" in artifact.data and f"| {name}/team-a |" in artifact.data
    assert f"{name}/team-b" not in artifact.data  # only the budgets this flow run touched
    assert "etl-hourly" in latest.data and "train-nightly" in latest.data and "## By tenant" in latest.data


def test_only_a_principal_that_ran_in_a_flow_run_may_publish_its_usage(two_tenants_ran):
    name, nightly_run, hourly_run, plane = two_tenants_ran
    stranger = plane.issue("team-b/etl", authority=name, budget=name, tenant="team-b")
    refused = plane.request("POST", f"/v1/flow-runs/{nightly_run}/usage-artifacts", stranger)
    assert refused.status_code == 403 and "ran nothing in flow run" in refused.json()["error"]


def test_a_report_that_cannot_be_published_never_fails_the_flow(prefect_api, gpu_cluster, plane_home, tmp_path_factory):
    import logging
    # A control plane whose Prefect API is down: its runs settle, their usage artifacts cannot be published.
    plane = _own_plane(tmp_path_factory, gpu_cluster, plane_home, "no-prefect-plane",
                       PREFECT_API_URL="http://127.0.0.1:9/api")
    try:
        plane.apply("budget", "org", BudgetBlock(**PRICES, limit=1))
        plane.apply("authority", "org", AuthorityBlock(grants=[Grant(id="root", principal="team-a/llm", max_cost_per_run=1.0)]))
        token = plane.issue("team-a/llm", authority="org", budget="org")

        @ai_task(kind="model-call", model="gpt-x", est_tokens=100)
        def ask():
            report_usage(tokens=50)
            return "answer"

        @flow(task_runner=AISchedTaskRunner(control_plane=plane.url, credential=token))
        def llm():
            return ask()

        class Caught(logging.Handler):  # the tests run with -p no:logging (no caplog)
            def __init__(self) -> None:
                super().__init__(logging.ERROR)
                self.lines: list[str] = []

            def emit(self, record: logging.LogRecord) -> None:
                self.lines.append(record.getMessage())

        caught = Caught()
        logging.getLogger("aisched_prefect").addHandler(caught)
        try:
            assert llm() == "answer"
        finally:
            logging.getLogger("aisched_prefect").removeHandler(caught)
        text = "\n".join(caught.lines)
        assert "could not publish the usage report artifacts" in text and "127.0.0.1:9" in text, text
        assert [r.tokens for r in usage_rows(plane.ledger())] == [50]
    finally:
        plane.stop()
