"""Usage and cost reports: GPU-hours, tokens and money per settled AI run, read from the ledger alone.

Money is what the ledger *posted* (the holds' charged micro-units), never a
re-pricing, so a report's totals equal the budgets' posted totals exactly;
cents appear only when a figure is displayed. A run charges every account that
covers it (the block's limit, the scoped limits under it, a grant's share), all
by the same amount, so its money is read from one of them: the shallowest
money account (`team-a` before `team-a/nightly` and `team-a#half`). GPU-hours
and tokens are what ran, from the settlement evidence. Holds whose lease ran
out were charged in full ("expired"); their runs are reported with the
estimate they held, since nobody knows what ran.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Iterable, Mapping
from datetime import date, datetime, time as dtime, timedelta, timezone
from decimal import ROUND_HALF_UP, Decimal
from typing import Any, Literal, TextIO
from uuid import UUID

from pydantic import BaseModel, ConfigDict

from aisched_prefect.errors import AISchedError
from aisched_prefect.ledger import MICROS, Ledger, rolling_seconds, to_micros
from aisched_prefect.ledger.queries import SETTLED_KINDS, settled_runs

GroupBy = Literal["tenant", "principal", "flow", "model", "gpu-type", "day"]
GROUPS: tuple[str, ...] = ("tenant", "principal", "flow", "model", "gpu-type", "kind", "day")
NONE = "(none)"  # the group of runs without a model or GPU type
UNKNOWN_FLOW = "(unknown)"
CENT = Decimal("0.01")
MICRO = Decimal("0.000001")
CSV_COLUMNS = ["settled_at", "flow_run_id", "task_run_id", "task", "tenant", "principal", "flow", "model", "gpu_type",
               "kind", "outcome", "gpus", "seconds", "gpu_hours", "tokens", "money", "uncovered", "money_account"]


class InvalidReportOption(AISchedError, ValueError):
    """A report was asked for with an option it cannot use; names the option and a valid value."""

    def __init__(self, option: str, value: object, fix: str) -> None:
        self.option, self.value, self.fix = option, value, fix
        super().__init__(f"{option} {value!r}: {fix}")


class PlotUnavailable(AISchedError):
    """Plotting needs matplotlib, which is an optional extra."""


def cents(amount: Decimal) -> Decimal:
    """Money as it is displayed: rounded half-up to the cent (the exact figure stays in micro-units)."""
    return amount.quantize(CENT, rounding=ROUND_HALF_UP)


def _dec(micros: int) -> Decimal:
    return (Decimal(micros) / MICROS).quantize(MICRO)


class Charge(BaseModel):
    """What one run posted on one account (summed over its holds: the run's and its top-ups')."""

    model_config = ConfigDict(frozen=True)

    budget: str
    period: str
    unit: str
    micros: int


class UsageRow(BaseModel):
    """One settled AI run: who, what, where it ran, what it used and what the ledger charged."""

    model_config = ConfigDict(frozen=True)

    settled_at: datetime
    flow_run_id: str | None
    task_run_id: str
    task: str | None
    tenant: str
    principal: str | None
    flow: str
    model: str | None
    gpu_type: str | None
    kind: str | None
    outcome: str
    gpus: float
    seconds: float | None
    gpu_hours: Decimal
    tokens: int
    money: Decimal
    """Posted on `money_account`, exact to the micro-unit, in the budget block's currency."""
    uncovered: Decimal
    """Money the run used past its budgets' room: not charged, recorded in the settlement."""
    money_account: str | None
    charges: list[Charge]
    periods: int = 1
    """Idle time (`warm-idle`): the waits its settlement covers (a stretch of back-to-back runs settles several)."""

    def key(self, by: str) -> str:
        if by == "day":
            return self.settled_at.date().isoformat()
        value = {"tenant": self.tenant, "principal": self.principal, "flow": self.flow, "model": self.model,
                 "gpu-type": self.gpu_type, "kind": self.kind}[by]
        return value or NONE

    def flat(self) -> dict[str, Any]:
        """The row as finance exports it: exact decimals as strings, no nested charges."""
        out = self.model_dump(mode="json", exclude={"charges"})
        out["settled_at"] = self.settled_at.isoformat()
        return {c: out[c] for c in CSV_COLUMNS}


class GroupTotal(BaseModel):
    """Runs of one group summed: exact figures."""

    model_config = ConfigDict(frozen=True)

    key: str
    runs: int
    gpu_hours: Decimal
    tokens: int
    money: Decimal
    uncovered: Decimal


class BudgetRow(BaseModel):
    """One ledger account against its limit, in its unit; `in_report` is what the report's runs posted on it."""

    model_config = ConfigDict(frozen=True)

    budget: str
    period: str
    unit: str
    limit: Decimal
    posted: Decimal
    held: Decimal
    remaining: Decimal
    used_pct: Decimal | None
    in_report: Decimal
    rolling: bool


class UsageReport(BaseModel):
    """Everything `aisched report` shows: the runs, their groups, the total and the budgets."""

    model_config = ConfigDict(frozen=True)

    by: str
    runs: list[UsageRow]
    groups: list[GroupTotal]
    total: GroupTotal
    budgets: list[BudgetRow]
    filtered: bool

    def mismatches(self) -> list[BudgetRow]:
        """Calendar accounts whose posted total the report's runs do not add up to (none, unless filtered)."""
        return [] if self.filtered else [b for b in self.budgets if not b.rolling and b.in_report != b.posted]


# -- options ---------------------------------------------------------------------------
def check_by(by: str) -> str:
    if by not in GROUPS:
        raise InvalidReportOption("--by", by, f"group by one of {', '.join(GROUPS)} (e.g. --by principal)")
    return by


def parse_when(value: str | None, option: str, *, end: bool = False) -> datetime | None:
    """A --since/--until value (YYYY-MM-DD, or ISO 8601 with a time; UTC unless it says otherwise).

    A bare date given as an end means the end of that day, so `--until 2026-01-31` includes the 31st.
    """
    if value is None:
        return None
    try:
        if len(value) == 10:
            day = date.fromisoformat(value)
            start = datetime.combine(day, dtime.min, tzinfo=timezone.utc)
            return start + timedelta(days=1) if end else start
        when = datetime.fromisoformat(value)
    except ValueError:
        raise InvalidReportOption(option, value, "give a date as YYYY-MM-DD or a time as YYYY-MM-DDTHH:MM[:SS] "
                                  "(UTC unless it carries an offset), e.g. 2026-01-31") from None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


# -- reading the ledger ------------------------------------------------------------------
def _depth(budget: str) -> tuple[int, str]:
    return budget.count("/") + budget.count("#"), budget


def _charged_account(hs: list[Any], unit: str) -> str | None:
    """The run's shallowest account of `unit` it was charged on (a limit for a GPU type it did not land on was voided).

    One settlement posts the same micro-units on every account of a unit (nested accounts stay equal), so this
    account's charge is the run's.
    """
    accounts = sorted({h.budget for h in hs if h.unit == unit and h.status != "voided"}, key=_depth)
    return accounts[0] if accounts else None


def usage_rows(ledger: Ledger, *, flow_run_id: str | None = None, since: datetime | None = None,
               until: datetime | None = None, flow_names: Mapping[str, str] | None = None) -> list[UsageRow]:
    """One row per settled run (oldest first); runs that never ran and were charged nothing are left out.

    `flow_names` (flow run id -> flow name) names the flows of runs whose evidence does not.
    """
    held, records = settled_runs(ledger.reader, flow_run_id, since, until)
    by_run: dict[str, list[Any]] = {}
    for h in held:
        by_run.setdefault(h.task_run_id or f"hold-{h.id}", []).append(h)
    # A run may be settled more than once (preempted, charged, admitted again and settled at its end): every
    # settlement's seconds and tokens count, as every one was charged. Its request is its admission's: a top-up
    # record carries none, only the seconds it added to the cover.
    settled: dict[str, list[Any]] = {}
    asked: dict[str, Any] = {}
    topped: dict[str, list[float]] = {}
    for r in records:
        if r.task_run_id is None:
            continue
        if r.kind in SETTLED_KINDS:
            settled.setdefault(r.task_run_id, []).append(r)
        elif r.kind == "top-up":
            topped.setdefault(r.task_run_id, []).append(float((r.payload.get("top_up") or {}).get("seconds") or 0))
        else:
            asked[r.task_run_id] = r  # the last admission (a run admitted again holds anew)
    rows = []
    for run in sorted(set(by_run) | set(settled)):
        hs, recs = by_run.get(run, []), settled.get(run, [])
        placed = any(rec.payload.get("placement") for rec in recs)
        if any(h.status == "pending" for h in hs) or not (placed or any(h.status in ("posted", "expired") for h in hs)):
            continue  # still running, or never ran and charged nothing
        row = _row(run, hs, recs, asked.get(run), topped.get(run, []), flow_names or {})
        if (since is None or row.settled_at >= since) and (until is None or row.settled_at < until):
            rows.append(row)
    return sorted(rows, key=lambda r: (r.settled_at, r.task_run_id))


def _row(run: str, hs: list[Any], recs: list[Any], ask: Any, topped: list[float],
         flow_names: Mapping[str, str]) -> UsageRow:
    rec = recs[-1] if recs else None
    source = rec if rec is not None else ask
    p: dict[str, Any] = source.payload if source is not None else {}
    req = p.get("request") or (ask.payload.get("request") if ask is not None else None) or {}
    sums: dict[tuple[str, str, str], int] = {}
    for h in hs:
        sums[(h.budget, h.period, h.unit)] = sums.get((h.budget, h.period, h.unit), 0) + (h.charged_micros or 0)
    charges = [Charge(budget=b, period=per, unit=u, micros=m) for (b, per, u), m in sorted(sums.items())]
    account = _charged_account(hs, "money")
    money = sum((c.micros for c in charges if c.budget == account), 0)
    uncovered = sum(to_micros(s.get("uncovered") or 0) for r in recs for s in r.payload.get("settlements") or []
                    if s.get("budget") == account)
    placement = p.get("placement") or {}
    gpus = float(req.get("gpus") or 0)
    timed = [float(r.payload["seconds"]) for r in recs if r.payload.get("seconds") is not None]
    seconds = sum(timed) if timed else None
    # Where a gpu-hours budget counted the run, what it posted: the ledger carries each account's rounding remainder,
    # so a run may post one micro-unit more or less than its own rounded hours, and report and budget must agree.
    # Otherwise each settlement's own seconds; with none (its holds expired) what it held, the estimate and each
    # top-up, since nobody knows what ran.
    hours_account = _charged_account(hs, "gpu-hours")
    if hours_account is not None:
        gpu_micros = sum((c.micros for c in charges if c.budget == hours_account), 0)
    else:
        spans = timed if timed else [float(req.get("est_seconds") or 0), *topped]
        gpu_micros = sum(to_micros(gpus * x / 3600) for x in spans)
    tokens = sum(int(r.payload["usage"]["tokens"]) if r.payload.get("usage") else int(req.get("est_tokens") or 0)
                 for r in recs) if recs else int(req.get("est_tokens") or 0)
    gpu_type = placement.get("gpu_type") or (p.get("estimate") or {}).get("gpu_type_priced")
    if gpu_type is None and isinstance(req.get("gpu_type"), str):
        gpu_type = req["gpu_type"]
    stamps = [h.settled_at for h in hs if h.settled_at is not None]
    ts = max(stamps) if stamps else rec.ts
    first = hs[0] if hs else None
    principal = (source.principal if source is not None else None) or (first.principal if first else None)
    flow_run = (source.flow_run_id if source is not None else None) or (first.flow_run_id if first else None)
    expired = any(h.status == "expired" for h in hs)
    outcome = "expired" if rec is None else p.get("outcome") or "settled"
    if rec is not None and expired:
        outcome += " (lease expired)"
    return UsageRow(
        settled_at=datetime.fromtimestamp(ts, timezone.utc), flow_run_id=flow_run, task_run_id=run,
        task=p.get("task"), tenant=p.get("tenant") or (principal or NONE).split("/")[0], principal=principal,
        flow=p.get("flow") or flow_names.get(flow_run or "") or UNKNOWN_FLOW, model=req.get("model"),
        gpu_type=gpu_type, kind=req.get("kind"), outcome=outcome, gpus=gpus, seconds=seconds,
        gpu_hours=_dec(gpu_micros) if gpus else Decimal("0.000000"), tokens=tokens,
        money=_dec(money), uncovered=_dec(uncovered), money_account=account, charges=charges,
        periods=int(p.get("periods") or 1),
    )


def aggregate(rows: Iterable[UsageRow], by: str, *, per_day: bool = False) -> list[GroupTotal]:
    """Rows summed per group of `by` (and per UTC day, with per_day: key 'YYYY-MM-DD <group>'), by key."""
    check_by(by)
    acc: dict[str, list[UsageRow]] = {}
    for r in rows:
        key = r.key(by)
        acc.setdefault(f"{r.key('day')} {key}" if per_day and by != "day" else key, []).append(r)
    return [_total(k, rs) for k, rs in sorted(acc.items())]


def _total(key: str, rows: list[UsageRow]) -> GroupTotal:
    zero = Decimal("0.000000")
    return GroupTotal(key=key, runs=len(rows), gpu_hours=sum((r.gpu_hours for r in rows), zero),
                      tokens=sum(r.tokens for r in rows), money=sum((r.money for r in rows), zero),
                      uncovered=sum((r.uncovered for r in rows), zero))


def budget_rows(ledger: Ledger, rows: Iterable[UsageRow], *, only_touched: bool = False) -> list[BudgetRow]:
    """Every ledger account against its limit (or only those the rows charged), with what the rows posted on it."""
    posted_by: dict[tuple[str, str], int] = {}
    for r in rows:
        for c in r.charges:
            posted_by[(c.budget, c.period)] = posted_by.get((c.budget, c.period), 0) + c.micros
    out = []
    for a in ledger.accounts():
        key = (a["budget"], a["period"])
        if only_touched and key not in posted_by:
            continue
        limit, posted, held = to_micros(a["limit"]), to_micros(a["posted"]), to_micros(a["pending"])
        used = (Decimal((posted + held) * 100) / limit).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP) if limit else None
        out.append(BudgetRow(budget=a["budget"], period=a["period"], unit=a["unit"], limit=_dec(limit),
                             posted=_dec(posted), held=_dec(held), remaining=_dec(limit - posted - held),
                             used_pct=used, in_report=_dec(posted_by.get(key, 0)),
                             rolling=rolling_seconds(a["period"]) is not None))
    return out


def name_flows(rows: list[UsageRow], lookup: Callable[[set[str]], Mapping[str, str]]) -> list[UsageRow]:
    """`rows`, those whose evidence does not name their flow named by `lookup` (flow run ids -> names), asked once."""
    unnamed = {r.flow_run_id for r in rows if r.flow == UNKNOWN_FLOW and r.flow_run_id}
    if not unnamed:
        return rows
    names = lookup(unnamed)
    return [r.model_copy(update={"flow": names[r.flow_run_id]}) if r.flow == UNKNOWN_FLOW and r.flow_run_id in names
            else r for r in rows]


def build_report(ledger: Ledger, *, by: str = "tenant", since: datetime | None = None, until: datetime | None = None,
                 flow_run_id: str | None = None, flow_names: Mapping[str, str] | None = None,
                 flow_lookup: Callable[[set[str]], Mapping[str, str]] | None = None) -> UsageReport:
    """The runs, grouped by `by`, with their total and every budget account.

    `flow_names` / `flow_lookup` name the flows of runs whose evidence does not (a mapping, or a call
    asked once with the flow run ids that need a name).
    """
    check_by(by)
    if since is not None and until is not None and since >= until:
        raise InvalidReportOption("--since", since.isoformat(), f"must be before --until ({until.isoformat()})")
    rows = usage_rows(ledger, flow_run_id=flow_run_id, since=since, until=until, flow_names=flow_names)
    if flow_lookup is not None:
        rows = name_flows(rows, flow_lookup)
    return UsageReport(by=by, runs=rows, groups=aggregate(rows, by), total=_total("total", rows),
                       budgets=budget_rows(ledger, rows, only_touched=flow_run_id is not None),
                       filtered=any(x is not None for x in (since, until, flow_run_id)))


# -- exports -------------------------------------------------------------------------------
def write_csv(rows: Iterable[UsageRow], stream: TextIO) -> None:
    """One line per run, exact decimals (money to the micro-unit), for finance."""
    writer = csv.DictWriter(stream, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow(r.flat())


def json_lines(report: UsageReport) -> list[dict[str, Any]]:
    """The report as JSON objects, one per line: runs, groups, the total and budgets, told apart by 'record'."""
    out: list[dict[str, Any]] = [{"record": "run", **r.flat()} for r in report.runs]
    out += [{"record": "group", "by": report.by, **g.model_dump(mode="json")} for g in report.groups]
    out.append({"record": "total", **report.total.model_dump(mode="json")})
    out += [{"record": "budget", **b.model_dump(mode="json")} for b in report.budgets]
    return out


def plot_spend(rows: list[UsageRow], by: str, path: str, *, title: str = "Cumulative AI spend") -> None:
    """A PNG of cumulative money over settlement time, one line per group of `by`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install '.[report]' (or pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    try:
        lines: dict[str, tuple[list[datetime], list[Decimal]]] = {}
        for r in rows:
            xs, ys = lines.setdefault(r.key(by), ([r.settled_at], [Decimal(0)]))  # each line starts at zero
            xs.append(r.settled_at)
            ys.append(ys[-1] + r.money)
        for key, (xs, ys) in sorted(lines.items()):
            ax.step(xs, [float(y) for y in ys], where="post", marker=".", label=f"{key} ({cents(ys[-1]):f})")
        ax.set_title(f"{title} by {by}")
        ax.set_xlabel("settled (UTC)")
        ax.set_ylabel("money charged (budget currency)")
        if lines:
            ax.legend(loc="upper left", fontsize="small")
        fig.autofmt_xdate()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


# -- display --------------------------------------------------------------------------------
def fmt_amount(value: Decimal, unit: str) -> str:
    """A figure in its unit as people read it: money to the cent, GPU-hours to 4 places, whole tokens."""
    if unit == "money":
        return f"{cents(value):f}"
    if unit == "gpu-hours":
        return f"{value.quantize(Decimal('0.0001'), rounding=ROUND_HALF_UP):f}"
    return f"{value.quantize(Decimal('1'), rounding=ROUND_HALF_UP):f}"


def group_table(report: UsageReport) -> list[dict[str, str]]:
    """The groups and the total as display strings."""
    return [{report.by: g.key, "runs": str(g.runs), "GPU-hours": fmt_amount(g.gpu_hours, "gpu-hours"),
             "tokens": str(g.tokens), "money": fmt_amount(g.money, "money"),
             "uncovered": fmt_amount(g.uncovered, "money") if g.uncovered else ""}
            for g in [*report.groups, report.total]]


def budget_table(budgets: list[BudgetRow]) -> list[dict[str, str]]:
    return [{"budget": b.budget, "period": b.period, "unit": b.unit,
             "limit": fmt_amount(b.limit, b.unit), "posted": fmt_amount(b.posted, b.unit),
             "held": fmt_amount(b.held, b.unit), "remaining": fmt_amount(b.remaining, b.unit),
             "used": "-" if b.used_pct is None else f"{b.used_pct}%", "in report": fmt_amount(b.in_report, b.unit)}
            for b in budgets]


def _md(rows: list[dict[str, str]]) -> str:
    if not rows:
        return "_none_\n"
    cols = list(rows[0])
    esc = [[str(r[c]).replace("|", "\\|") for c in cols] for r in rows]
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols), *("| " + " | ".join(r) + " |" for r in esc)]) + "\n"


def _groups_md(rows: list[UsageRow], by: str) -> str:
    totals = aggregate(rows, by)
    return _md([{by: g.key, "runs": str(g.runs), "GPU-hours": fmt_amount(g.gpu_hours, "gpu-hours"),
                 "tokens": str(g.tokens), "money": fmt_amount(g.money, "money")} for g in totals])


def flow_run_markdown(rows: list[UsageRow], budgets: list[BudgetRow], flow_run_id: str) -> str:
    """The flow run's artifact: its usage by task, model and GPU type, and the budgets it touched."""
    total = _total("total", rows)
    flows = sorted({r.flow for r in rows})
    parts = [f"# AI usage of flow run {flow_run_id}" + (f" ({', '.join(flows)})" if flows else ""), "",
             f"{total.runs} settled AI run(s): {fmt_amount(total.gpu_hours, 'gpu-hours')} GPU-hours, {total.tokens} tokens, "
             f"{fmt_amount(total.money, 'money')} charged (budget currency), from the aisched ledger.", "",
             "## By task", "",
             _md([{"task": r.task or "?", "task run": r.task_run_id, "model": r.model or NONE, "GPU type": r.gpu_type or NONE,
                   "outcome": r.outcome, "GPU-hours": fmt_amount(r.gpu_hours, "gpu-hours"), "tokens": str(r.tokens),
                   "money": fmt_amount(r.money, "money")} for r in rows]),
             "## By model", "", _groups_md(rows, "model"), "## By GPU type", "", _groups_md(rows, "gpu-type"),
             "## Budgets it touched", "", _md(budget_table(budgets))]
    return "\n".join(parts)


def day_markdown(rows: list[UsageRow], budgets: list[BudgetRow], day: date) -> str:
    """The day's artifact: every run settled that UTC day, by tenant, flow, model and GPU type, and every budget."""
    total = _total("total", rows)
    parts = [f"# AI usage on {day.isoformat()} (UTC)", "",
             f"{total.runs} settled AI run(s): {fmt_amount(total.gpu_hours, 'gpu-hours')} GPU-hours, {total.tokens} tokens, "
             f"{fmt_amount(total.money, 'money')} charged (budget currency). Updated by each flow run that day.", ""]
    for by in ("tenant", "principal", "flow", "model", "gpu-type"):
        parts += [f"## By {by}", "", _groups_md(rows, by)]
    parts += ["## Budgets", "", _md(budget_table(budgets))]
    return "\n".join(parts)


# -- Prefect ----------------------------------------------------------------------------------
def flow_run_key(flow_run_id: str) -> str:
    """`aisched-usage-<first 8 hex digits>`: artifact keys allow lowercase letters, digits and dashes only."""
    return f"aisched-usage-{UUID(str(flow_run_id)).hex[:8]}"


def day_key(day: date) -> str:
    return f"aisched-usage-{day.isoformat()}"


def prefect_flow_names(client: Any, flow_run_ids: Iterable[str]) -> dict[str, str]:
    """Flow names of flow runs, from the Prefect API (the evidence may not carry them)."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterId, FlowRunFilter, FlowRunFilterId

    ids = []
    for i in set(flow_run_ids):
        try:
            ids.append(UUID(i))
        except (TypeError, ValueError):
            continue
    if not ids:
        return {}
    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)), limit=len(ids))
    flows = client.read_flows(flow_filter=FlowFilter(id=FlowFilterId(any_=list({r.flow_id for r in runs}))))
    names = {f.id: f.name for f in flows}
    return {str(r.id): names[r.flow_id] for r in runs if r.flow_id in names}


def _client_or_new(client: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
    if client is not None:
        return fn(*args, client=client, **kwargs)
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as own:
        return fn(*args, client=own, **kwargs)


def publish_flow_run_artifact(ledger: Ledger, flow_run_id: str, *, client: Any = None) -> str:
    """Create the flow run's usage artifact; returns its key. Reads only that flow run's records."""
    if client is None:
        return _client_or_new(None, publish_flow_run_artifact, ledger, flow_run_id)
    from prefect.client.schemas.actions import ArtifactCreate

    rows = name_flows(usage_rows(ledger, flow_run_id=flow_run_id), lambda ids: prefect_flow_names(client, ids))
    key = flow_run_key(flow_run_id)
    client.create_artifact(ArtifactCreate(
        key=key, type="markdown", flow_run_id=UUID(str(flow_run_id)),
        data=flow_run_markdown(rows, budget_rows(ledger, rows, only_touched=True), flow_run_id),
        description="GPU-hours, tokens and money of this flow run's AI tasks, and the budgets they touched."))
    return key


def publish_day_artifact(ledger: Ledger, *, client: Any = None, now: datetime | None = None) -> str:
    """Overwrite the day's usage artifact (a new version under the same key); returns its key.

    It reads the whole day, so the control plane publishes it on a schedule, not at every flow run's end.
    """
    if client is None:
        return _client_or_new(None, publish_day_artifact, ledger, now=now)
    from prefect.client.schemas.actions import ArtifactCreate

    day = (now or datetime.now(timezone.utc)).astimezone(timezone.utc).date()
    start = datetime.combine(day, dtime.min, tzinfo=timezone.utc)
    rows = name_flows(usage_rows(ledger, since=start, until=start + timedelta(days=1)),
                      lambda ids: prefect_flow_names(client, ids))
    key = day_key(day)
    client.create_artifact(ArtifactCreate(
        key=key, type="markdown", data=day_markdown(rows, budget_rows(ledger, rows), day),
        description=f"Every AI run settled on {day.isoformat()} (UTC) in this ledger, against every budget."))
    return key


def csv_text(rows: Iterable[UsageRow]) -> str:
    buf = io.StringIO()
    write_csv(rows, buf)
    return buf.getvalue()
