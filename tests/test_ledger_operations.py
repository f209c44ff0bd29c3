"""The ledger under real operations (issue 15): operator edits, concurrency, skewed clocks, bad values, crashes.

Each numbered problem of the issue has a test here that failed before it was fixed.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from fractions import Fraction

import pytest
import sqlalchemy as sa

from aisched_prefect import Ledger
from aisched_prefect.ledger import BudgetExceeded, BudgetLine, InvalidAmount, holds, to_micros

IDS = {"flow_run_id": "f", "task_run_id": "t", "principal": "team-a/x"}
NO_IDS = {"flow_run_id": None, "task_run_id": None, "principal": None}
P = "2026-11"


def line(budget: str, limit: float, amount: float = 0.0, version: int | None = None, **kw) -> BudgetLine:
    return BudgetLine(budget=budget, period=kw.pop("period", P), limit=limit, amount=amount, config_version=version, **kw)


def reserve(ledger: Ledger, lines: list[BudgetLine], amount: float | None = None, **kw):
    return ledger.reserve(lines, amount, kind="admission", payload={}, **{**IDS, **kw})


def settle(ledger: Ledger, hold_ids: list[str], actual, **kw):
    return ledger.settle(hold_ids, actual, kind="settlement", payload={}, **{**IDS, **kw})


def run_out(ledger: Ledger, hold_ids: list[str]) -> None:
    """The holder's process died long ago: these holds' lease ran out (by any clock)."""
    with ledger.engine.begin() as conn:
        conn.execute(holds.update().where(holds.c.id.in_(hold_ids)).values(lease_until=holds.c.lease_until - 10_000))


def micros(ledger: Ledger, budget: str, period: str = P) -> dict[str, int]:
    acct = ledger.account(budget, period)
    return {k: to_micros(acct[k]) for k in ("limit", "pending", "posted")}


# -- 1. limits come from the applied configuration, versioned ------------------------------------
def test_a_flow_holding_an_old_budget_line_never_undoes_an_operators_cut(ledger_url):
    """The issue's case: a flow still holding the old block (limit 10) posted 8.5 on an account cut to 5."""
    ledger = Ledger(ledger_url)
    stale, cut = line("team", 10.0, version=1), line("team", 5.0, version=2)
    reserve(ledger, [stale], 1.0)
    reserve(ledger, [cut], 1.0)  # a flow started after the operator's edit
    with pytest.raises(BudgetExceeded, match="left of 5.0000"):
        reserve(ledger, [stale], 8.5)
    reserve(ledger, [stale], 3.0)  # what fits under 5 still fits
    assert micros(ledger, "team")["limit"] == 5_000_000
    assert [(c["budget"], c["limit"], c["version"]) for c in ledger.limits()] == [("team", 5.0, 2)]
    changes = [r.payload for r in ledger.records() if r.kind == "budget-limits"]
    assert [[c["limit"] for c in p["changed"]] for p in changes] == [[10.0], [5.0]]


def test_a_lowered_limit_applies_to_the_next_reservation_in_every_process_and_period(ledger_url):
    flow_process, control_plane = Ledger(ledger_url), Ledger(ledger_url)
    stale = line("team", 10.0, version=1)
    reserve(flow_process, [stale], 1.0)
    applied = control_plane.apply_limits([line("team", 2.0), line("team/flow-a", 1.0)], version=2, by="operator")
    assert applied.changed == ["team", "team/flow-a"] and applied.stale == [] and applied.record.kind == "budget-limits"
    assert micros(flow_process, "team")["limit"] == 2_000_000  # every account of the budget, at once
    with pytest.raises(BudgetExceeded, match="left of 2.0000"):
        reserve(flow_process, [stale], 1.5)
    with pytest.raises(BudgetExceeded, match="left of 2.0000"):  # next month's account, first made by a stale line
        reserve(flow_process, [line("team", 10.0, version=1, period="2026-12")], 2.5)
    with pytest.raises(BudgetExceeded):  # a line from no versioned configuration does not widen it either
        reserve(flow_process, [line("team", 10.0)], 1.5)
    assert control_plane.apply_limits([line("team", 50.0)], version=1).stale == ["team"]  # older: changes nothing
    assert micros(flow_process, "team")["limit"] == 2_000_000
    control_plane.apply_limits([line("team", 20.0)], version=3)  # a raise applies the same way
    reserve(flow_process, [stale], 15.0)


# -- 2. a run's holds are reserved, renewed, expired and settled together --------------------------
def test_a_lost_runs_holds_expire_together_and_a_late_settlement_changes_nothing(ledger_url):
    """The issue's case: the hold on `team` expired in full while the one on `team/flow-1` was settled at 0.1."""
    ledger = Ledger(ledger_url)
    lost, _ = reserve(ledger, [line("team", 1.0), line("team/flow-1", 1.0)], 0.8)
    run_out(ledger, [h.id for h in lost])
    with pytest.raises(BudgetExceeded):  # needs the room: the lost run expires whole (charged in full: still none)
        reserve(ledger, [line("team", 1.0), line("team/flow-2", 1.0)], 0.5)
    late, record = settle(ledger, [lost[1].id], 0.1)  # its owner comes back, settling by the flow's hold
    assert record is None and [(s.status, s.first) for s in late] == [("expired", False), ("expired", False)]
    held, _ = reserve(ledger, [line("team", 1.0), line("team/flow-2", 1.0)], 0.15)
    team, one, two = micros(ledger, "team"), micros(ledger, "team/flow-1"), micros(ledger, "team/flow-2")
    assert team["posted"] == one["posted"] + two["posted"] == 800_000
    assert team["pending"] == one["pending"] + two["pending"] == 150_000


def test_renewing_or_settling_one_hold_of_a_run_renews_or_settles_all_of_its_holds(ledger_url):
    ledger = Ledger(ledger_url)
    held, _ = reserve(ledger, [line("team", 1.0), line("team/flow-1", 1.0)], 0.5, lease_seconds=30)
    ids = [h.id for h in held]
    assert held[0].group == held[1].group
    assert ledger.renew([ids[0]], lease_seconds=600) == set(ids)
    leases = {h["hold"]: h["lease_until"] for h in ledger.history("team")}
    assert leases[ids[0]] == leases[ids[1]]
    out, _ = settle(ledger, [ids[0]], 0.3)
    assert sorted((s.budget, s.charged) for s in out) == [("team", 0.3), ("team/flow-1", 0.3)]
    assert micros(ledger, "team")["posted"] == micros(ledger, "team/flow-1")["posted"] == 300_000


# -- 3. one lock order, deadlocks and serialization failures retried --------------------------------
class _DbError(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(f"sqlstate {sqlstate}")
        self.sqlstate = sqlstate


@pytest.mark.parametrize("sqlstate", ["40P01", "40001"])  # deadlock detected, serialization failure
def test_a_deadlock_or_serialization_failure_is_retried_never_surfaced(ledger_url, sqlstate):
    ledger = Ledger(ledger_url)
    tries = []

    def op(w):
        tries.append(1)
        w.append("probe", {"try": len(tries)}, NO_IDS)
        if len(tries) < 3:
            raise sa.exc.OperationalError("UPDATE aisched_holds ...", {}, _DbError(sqlstate))
        return "done"

    assert ledger._write(op) == "done" and len(tries) == 3
    assert [r.payload for r in ledger.records()] == [{"try": 3}] and ledger.verify().ok


def test_renewals_racing_settlements_never_deadlock(ledger_url):
    """The issue's case: renew's unlocked select and UPDATE ... IN against settle's locks: DeadlockDetected."""
    ledger = Ledger(ledger_url, lease_seconds=600)
    live: list[str] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    done = threading.Event()
    accounts = [line(f"org/a{k}", 1e6) for k in range(6)]

    def renewer(seed: int) -> None:
        rng = random.Random(seed)
        while not done.is_set():
            with lock:
                ids = list(live)
            rng.shuffle(ids)
            try:
                ledger.renew(ids)
            except Exception as exc:  # noqa: BLE001 - any failure is the finding
                errors.append(exc)
                return

    def runs(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(40):
                held, _ = reserve(ledger, rng.sample(accounts, 4), 0.01)
                ids = [h.id for h in held]
                with lock:
                    live.extend(ids)
                rng.shuffle(ids)
                settle(ledger, ids, 0.005)
                with lock:
                    for i in ids:
                        live.remove(i)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    renewers = [threading.Thread(target=renewer, args=(s,)) for s in range(3)]
    workers = [threading.Thread(target=runs, args=(10 + s,)) for s in range(6)]
    for t in renewers + workers:
        t.start()
    for t in workers:
        t.join()
    done.set()
    for t in renewers:
        t.join()
    assert errors == []
    assert all(a["pending"] == 0 for a in ledger.accounts()) and ledger.verify().ok


# -- 4. one bad write fails only itself -----------------------------------------------------------
def _in_one_batch(ledger: Ledger, calls: dict[str, object], queued: int) -> dict[str, object]:
    """Run the calls on threads while the writer is held, so that `queued` of them land in one batch."""
    results: dict[str, object] = {}

    def call(name, fn):
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001
            results[name] = exc

    threads = [threading.Thread(target=call, args=item) for item in calls.items()]
    with ledger._write_lock:
        for t in threads:
            t.start()
        while len(ledger._queue) < queued or sum(t.is_alive() for t in threads) > len(ledger._queue):
            threading.Event().wait(0.01)
    for t in threads:
        t.join()
    return results


def test_a_write_that_fails_half_way_fails_alone_and_leaves_no_trace(ledger_url):
    ledger = Ledger(ledger_url)
    (first,), _ = reserve(ledger, [line("org", 1.0)], 0.5)

    def poisoned(w):  # wrote evidence, then broke
        w.append("half-done", {}, NO_IDS)
        raise RuntimeError("boom")

    results = _in_one_batch(ledger, {
        "reserve": lambda: reserve(ledger, [line("org", 1.0)], 0.2)[0][0],
        "bad": lambda: ledger._write(poisoned),
        "settle": lambda: settle(ledger, [first.id], 0.1)[0][0],
    }, queued=3)
    assert isinstance(results["bad"], RuntimeError)
    assert results["reserve"].reserved == 0.2 and results["settle"].charged == 0.1
    kinds = [r.kind for r in ledger.records() if r.kind != "budget-alert"]
    assert sorted(kinds) == ["admission", "admission", "settlement"] and ledger.verify().ok  # no "half-done"
    assert micros(ledger, "org") == {"limit": 1_000_000, "pending": 200_000, "posted": 100_000}


def test_a_nan_charge_is_refused_at_the_door_and_its_neighbours_commit(ledger_url):
    """The issue's case: one thread settling NaN made hundreds of valid writes fail and strand their holds."""
    ledger = Ledger(ledger_url)
    held = [reserve(ledger, [line("org", 10.0)], 1.0)[0][0] for _ in range(3)]
    results = _in_one_batch(ledger, {
        "good-1": lambda: settle(ledger, [held[0].id], 0.5)[0][0],
        "nan": lambda: settle(ledger, [held[1].id], math.nan),
        "good-2": lambda: settle(ledger, [held[2].id], 0.25)[0][0],
    }, queued=2)
    assert isinstance(results["nan"], InvalidAmount) and "actual=nan" in str(results["nan"])
    assert results["good-1"].charged == 0.5 and results["good-2"].charged == 0.25
    assert micros(ledger, "org") == {"limit": 10_000_000, "pending": 1_000_000, "posted": 750_000}


# -- 5. every amount is checked at the ledger's own API -------------------------------------------
BAD = [-1.0, -0.5, math.nan, math.inf, -math.inf, 1e13, 2**70, "1.0", True]


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_a_bad_amount_is_refused_naming_it_and_nothing_changes(ledger_url, bad):
    ledger = Ledger(ledger_url)
    (h,), _ = reserve(ledger, [line("org", 5.0)], 1.0)
    before = (ledger.records(), ledger.accounts())
    good = line("org", 5.0)
    for call in (lambda: reserve(ledger, [good], bad),
                 lambda: reserve(ledger, [good.model_copy(update={"amount": bad})]),  # copies skip validation
                 lambda: reserve(ledger, [good.model_copy(update={"limit": bad})], 1.0),
                 lambda: settle(ledger, [h.id], bad),
                 lambda: settle(ledger, [h.id], {"org": bad})):
        with pytest.raises(InvalidAmount, match=r"Fix: ") as info:
            call()
        assert repr(bad) in str(info.value)
    assert (ledger.records(), ledger.accounts()) == before


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, 1e9])
def test_a_bad_lease_is_refused(ledger_url, bad):
    ledger = Ledger(ledger_url)
    (h,), _ = reserve(ledger, [line("org", 5.0)], 1.0)
    with pytest.raises(InvalidAmount, match="lease_seconds"):
        reserve(ledger, [line("org", 5.0)], 1.0, lease_seconds=bad)
    with pytest.raises(InvalidAmount, match="lease_seconds"):
        ledger.renew([h.id], lease_seconds=bad)
    with pytest.raises(InvalidAmount, match="lease_seconds"):
        Ledger(ledger_url, lease_seconds=bad)


def test_a_negative_hold_cannot_make_room_and_a_negative_charge_cannot_refund(ledger_url):
    """The issue's cases: reserving -1 then 6 on a limit of 5 posted 6; settling -0.5 halved what was spent."""
    ledger = Ledger(ledger_url)
    with pytest.raises(InvalidAmount, match="amount=-1"):
        reserve(ledger, [line("org", 5.0)], -1.0)
    with pytest.raises(BudgetExceeded):
        reserve(ledger, [line("org", 5.0)], 6.0)
    (h,), _ = reserve(ledger, [line("org", 5.0)], 1.0)
    with pytest.raises(InvalidAmount, match="actual=-0.5"):
        settle(ledger, [h.id], -0.5)
    settle(ledger, [h.id], 1.0)
    assert micros(ledger, "org")["posted"] == 1_000_000


# -- 6. time from the database's clock ------------------------------------------------------------
def test_a_host_whose_clock_runs_ahead_neither_expires_live_holds_nor_forgets_the_window(ledger_url, monkeypatch):
    """The issue's case: a host 400 s ahead expired a live hold renewed moments before and charged it in full."""
    ledger = Ledger(ledger_url)
    week = line("org/week", 1.0, period="rolling-7d", rolling_seconds=7 * 86_400)
    held, _ = reserve(ledger, [line("org", 1.0), week], 0.8, lease_seconds=60)
    ids = [h.id for h in held]
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 400)
    ahead = Ledger(ledger_url)
    assert ahead.renew(ids) == set(ids)
    assert ahead.expire_holds() == []
    with pytest.raises(BudgetExceeded):  # the live run still holds its room
        reserve(ahead, [line("org", 1.0)], 0.3)
    assert {h["status"] for h in ahead.history("org")} == {"pending"}
    settle(ledger, ids, 0.5)
    monkeypatch.setattr(time, "time", lambda: real() + 8 * 86_400)  # a week past: still inside the window
    later = Ledger(ledger_url)
    assert later.account("org/week", "rolling-7d")["posted"] == 0.5
    with pytest.raises(BudgetExceeded):
        reserve(later, [week], 0.6)


def test_the_calendar_period_a_charge_falls_into_is_the_databases(ledger_url, monkeypatch):
    """A replica whose host clock runs 40 days ahead still names the database's month (the control plane builds
    every admission's budget lines at `ledger.now()`), so all replicas charge the same month's account."""
    from blocks.budget import period_key

    month = Ledger(ledger_url).now().strftime("%Y-%m")
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 40 * 86_400)
    ahead = Ledger(ledger_url)
    assert abs(ahead.now().timestamp() - real()) < 5
    host = datetime.fromtimestamp(time.time(), timezone.utc)  # what the host's own clock says: 40 days on
    assert period_key("monthly", ahead.now()) == month != period_key("monthly", host)


# -- 7. money never drifts ------------------------------------------------------------------------
def _charge_each(ledger: Ledger, runs: list[tuple[list[BudgetLine], float]]) -> None:
    def one(run):
        lines, amount = run
        held, _ = reserve(ledger, lines, amount)
        settle(ledger, [h.id for h in held], amount)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, runs))


def test_many_tiny_charges_post_their_true_sum(ledger_url):
    """The issue's case: 2,000 charges of 4e-7 posted 0; 2,000 x 1.5e-6 posted 33 % too much."""
    ledger = Ledger(ledger_url)
    _charge_each(ledger, [([line("tiny", 10.0)], 4e-7)] * 200 + [([line("odd", 10.0)], 1.5e-6)] * 200)
    assert abs(micros(ledger, "tiny")["posted"] - 80) < 1  # 200 x 0.4 micro-units
    assert abs(micros(ledger, "odd")["posted"] - 300) < 1


def test_nested_accounts_stay_equal_while_each_posts_its_true_sum(ledger_url):
    ledger = Ledger(ledger_url)
    rng = random.Random(7)
    runs = []
    for i in range(120):
        amount = (rng.randrange(1, 3000) + rng.choice((0.3, 0.45, 0.7))) * 1e-6  # no charge is whole micro-units
        runs.append(([line("team", 10.0), line(f"team/flow-{i % 2}", 10.0)], amount))
    _charge_each(ledger, runs)
    true = {b: sum((Fraction(a) for ls, a in runs if b in {x.budget for x in ls}), Fraction(0)) * 1_000_000
            for b in ("team", "team/flow-0", "team/flow-1")}
    posted = {b: micros(ledger, b)["posted"] for b in true}
    assert posted["team"] == posted["team/flow-0"] + posted["team/flow-1"]
    assert all(abs(posted[b] - true[b]) < 1 for b in true), (posted, {b: float(t) for b, t in true.items()})


# -- 9. the same account twice, budget show on Postgres, settling nothing ---------------------------
def test_the_same_account_twice_in_one_reservation_is_one_hold_of_the_sum(ledger_url):
    ledger = Ledger(ledger_url)
    with pytest.raises(BudgetExceeded, match="needs 1.2000"):
        reserve(ledger, [line("team", 1.0, 0.6), line("team", 1.0, 0.6)])
    (h,), _ = reserve(ledger, [line("team", 1.0, 0.3), line("team", 1.0, 0.3)])
    assert h.reserved == 0.6 and micros(ledger, "team")["pending"] == 600_000


def test_budget_show_lists_a_rolling_account(ledger_url):
    """The issue's case: `aisched budget show` crashed on Postgres with a rolling-window account (Decimal)."""
    from typer.testing import CliRunner

    from aisched_prefect.cli import app

    ledger = Ledger(ledger_url)
    week = line("org/week", 5.0, period="rolling-7d", rolling_seconds=7 * 86_400)
    held, _ = reserve(ledger, [week], 2.0)
    settle(ledger, [h.id for h in held], 1.5)
    shown = CliRunner().invoke(app, ["budget", "show", "--ledger", ledger_url, "--json"])
    assert shown.exit_code == 0, shown.output
    (row,) = map(json.loads, shown.stdout.splitlines())
    assert (row["posted"], row["remaining"], row["used"]) == (1.5, 3.5, "30%")


def test_settling_nothing_records_nothing(ledger_url):
    ledger = Ledger(ledger_url)
    assert settle(ledger, [], 1.0) == ([], None)
    assert ledger.records() == []
