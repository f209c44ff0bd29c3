"""Ledger budgets on SQLite and Postgres: units, all-or-none nesting, leases, top-ups, alerts, rolling windows, migration."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from aisched_prefect import Ledger
from aisched_prefect.ledger import SCHEMA_VERSION, BudgetExceeded, schema_version
from blocks import BudgetLine

IDS = {"flow_run_id": "f", "task_run_id": "t", "principal": "team-a/x"}
P = "2026-11"


def money(budget: str, limit: float, amount: float) -> BudgetLine:
    return BudgetLine(budget=budget, period=P, limit=limit, amount=amount)


def test_a_hold_fits_every_account_in_its_unit_or_none_is_taken(ledger_url):
    ledger = Ledger(ledger_url)
    tokens = BudgetLine(budget="org/llm-tokens", period=P, limit=1000, amount=800, unit="tokens")
    ledger.reserve([money("org", 10, 1.0), tokens], kind="admission", payload={}, **IDS)
    with pytest.raises(BudgetExceeded, match=r"'org/llm-tokens' \(2026-11, tokens\) has 200.0000 left"):
        ledger.reserve([money("org", 10, 1.0), tokens], kind="admission", payload={}, **IDS)
    assert ledger.account("org", P)["pending"] == 1.0  # the money account was not touched by the refused run
    assert {a["budget"]: a["unit"] for a in ledger.accounts()} == {"org": "money", "org/llm-tokens": "tokens"}


def test_a_full_parent_refuses_a_child_with_room(ledger_url):
    ledger = Ledger(ledger_url)
    ledger.reserve([money("team", 1.0, 0.9), money("team/a", 1.0, 0.9)], kind="admission", payload={}, **IDS)
    with pytest.raises(BudgetExceeded, match="'team'"):
        ledger.reserve([money("team", 1.0, 0.2), money("team/b", 1.0, 0.2)], kind="admission", payload={}, **IDS)
    assert ledger.account("team/b", P) is None  # refused: nothing held on it, and no account made for it either


def test_a_run_and_its_top_ups_share_one_charge_in_order(ledger_url):
    ledger = Ledger(ledger_url)
    held, _ = ledger.reserve([money("org", 10, 1.0)], kind="admission", payload={}, **IDS)
    top, _ = ledger.reserve([money("org", 10, 0.5)], kind="top-up", payload={}, **IDS)
    out, _ = ledger.settle([held[0].id, top[0].id], {"org": 1.2}, kind="settlement", payload={}, **IDS)
    assert [(s.charged, round(s.released, 6)) for s in out] == [(1.0, 0.0), (pytest.approx(0.2), 0.3)]
    assert ledger.account("org", P) == {"limit": 10.0, "pending": 0.0, "posted": pytest.approx(1.2), "remaining": pytest.approx(8.8)}


def test_an_account_left_out_of_the_charges_is_voided(ledger_url):
    """A run that could land on H100 or A10 held both type budgets; it ran on A10."""
    ledger = Ledger(ledger_url)
    lines = [BudgetLine(budget=f"org/{t}", period=P, limit=10, amount=2.0, unit="gpu-hours") for t in ("h100", "a10")]
    held, _ = ledger.reserve(lines, kind="admission", payload={}, **IDS)
    ledger.settle([h.id for h in held], {"org/a10": 1.5}, kind="settlement", payload={}, **IDS)
    assert ledger.account("org/a10", P)["posted"] == 1.5 and ledger.account("org/h100", P)["posted"] == 0
    assert {h["budget"]: h["status"] for h in ledger.history("org")} == {"org/a10": "posted", "org/h100": "voided"}


def test_a_hold_whose_lease_ran_out_expires_charged_in_full_when_its_room_is_needed(ledger_url):
    ledger = Ledger(ledger_url)
    (stale,), _ = ledger.reserve([money("org", 1.0, 0.6)], kind="admission", payload={}, lease_seconds=0.2, **IDS)
    (fresh,), _ = ledger.reserve([money("org", 1.0, 0.3)], kind="admission", payload={}, lease_seconds=60, **IDS)
    time.sleep(0.3)
    assert ledger.renew([stale.id, fresh.id]) == {fresh.id}  # a lease that ran out is not revived
    ledger.reserve([money("org", 1.0, 0.05)], kind="admission", payload={}, **IDS)  # fits: no expiry needed
    assert ledger.history("org", task_run_id="t")[-1]["status"] == "pending"
    with pytest.raises(BudgetExceeded):  # the stale hold expires, charged 0.6 (outcome unknown): still no room
        ledger.reserve([money("org", 1.0, 0.2)], kind="admission", payload={}, **IDS)
    assert {h["hold"]: h["status"] for h in ledger.history("org")}[stale.id] == "expired"
    assert ledger.account("org", P)["posted"] == pytest.approx(0.6)
    (late,), record = ledger.settle([stale.id], 0.1, kind="settlement", payload={}, **IDS)
    assert not late.first and late.status == "expired" and record is None  # nothing is charged twice
    assert [r.kind for r in ledger.records()].count("hold-expired") == 1 and ledger.verify().ok


def test_expire_holds_sweeps_every_account(ledger_url):
    ledger = Ledger(ledger_url, lease_seconds=0.1)
    for budget in ("a", "b"):
        ledger.reserve([money(budget, 5, 1.0)], kind="admission", payload={}, **IDS)
    time.sleep(0.2)
    assert len(ledger.expire_holds()) == 2 and ledger.expire_holds() == []
    assert [a["posted"] for a in ledger.accounts()] == [1.0, 1.0]


def test_alerts_fire_once_per_upward_crossing(ledger_url):
    alerts = []
    ledger = Ledger(ledger_url, on_alert=alerts.append)
    (a,), _ = ledger.reserve([money("org", 10, 4.0)], kind="admission", payload={}, **IDS)
    assert alerts == []
    (b,), _ = ledger.reserve([money("org", 10, 4.5)], kind="admission", payload={}, **IDS)  # 85%: crosses 50 and 80
    assert [x.threshold for x in alerts] == [50, 80]
    ledger.reserve([money("org", 10, 0.1)], kind="admission", payload={}, **IDS)  # 86%: nothing new
    assert len(alerts) == 2
    ledger.settle([b.id], None, kind="settlement", payload={}, **IDS)  # back to 41%: re-armed
    ledger.reserve([money("org", 10, 5.9)], kind="admission", payload={}, **IDS)  # 100%
    assert [x.threshold for x in alerts] == [50, 80, 50, 80, 100]
    assert alerts[-1].used == pytest.approx(1.0) and alerts[-1].budget == "org"
    assert [r.kind for r in ledger.records()].count("budget-alert") == 2  # one record per write that crossed


def test_rolling_window_counts_only_recent_charges(ledger_url):
    ledger = Ledger(ledger_url)
    line = BudgetLine(budget="org/week", period="rolling-7d", limit=1.0, amount=0.8, rolling_seconds=7 * 86400)
    (old,), _ = ledger.reserve([line], kind="admission", payload={}, **IDS)
    ledger.settle([old.id], 0.8, kind="settlement", payload={}, **IDS)
    with pytest.raises(BudgetExceeded):
        ledger.reserve([line], kind="admission", payload={}, **IDS)
    with ledger.engine.begin() as conn:  # the charge was eight days ago
        conn.exec_driver_sql(f"UPDATE aisched_holds SET settled_at = {time.time() - 8 * 86400} WHERE id = '{old.id}'")
    assert ledger.account("org/week", "rolling-7d")["posted"] == 0
    ledger.reserve([line], kind="admission", payload={}, **IDS)


def test_history_lists_holds_and_charges_with_their_task_runs(ledger_url):
    ledger = Ledger(ledger_url)
    for i in range(3):
        (h,), _ = ledger.reserve([money("org", 10, 1.0)], kind="admission", payload={}, **{**IDS, "task_run_id": f"t{i}"})
        ledger.settle([h.id], 0.5, kind="settlement", payload={}, **{**IDS, "task_run_id": f"t{i}"})
    rows = ledger.history("org")
    assert [r["task_run_id"] for r in rows] == ["t2", "t1", "t0"]
    assert all(r["status"] == "posted" and r["charged"] == 0.5 and r["reserved"] == 1.0 for r in rows)


V3 = [
    "CREATE TABLE aisched_schema (version INTEGER NOT NULL)",
    "CREATE TABLE aisched_budget_accounts (budget VARCHAR(200) NOT NULL, period VARCHAR(32) NOT NULL, "
    "limit_micros BIGINT NOT NULL, pending_micros BIGINT NOT NULL, posted_micros BIGINT NOT NULL, PRIMARY KEY (budget, period))",
    "CREATE TABLE aisched_holds (id VARCHAR(36) NOT NULL PRIMARY KEY, budget VARCHAR(200) NOT NULL, period VARCHAR(32) NOT NULL, "
    "flow_run_id VARCHAR(64), task_run_id VARCHAR(64), principal VARCHAR(200), reserved_micros BIGINT NOT NULL, "
    "charged_micros BIGINT, status VARCHAR(16) NOT NULL, created_at FLOAT NOT NULL, settled_at FLOAT)",
    "CREATE TABLE aisched_chain_head (id INTEGER NOT NULL PRIMARY KEY, seq BIGINT NOT NULL, hash VARCHAR(64) NOT NULL)",
    "INSERT INTO aisched_schema VALUES (3)",
    f"INSERT INTO aisched_chain_head VALUES (1, 0, '{'0' * 64}')",
    "INSERT INTO aisched_budget_accounts VALUES ('org', '2026-11', 5000000, 1000000, 2000000)",
    "INSERT INTO aisched_holds VALUES ('h-old', 'org', '2026-11', 'f', 't', 'p', 1000000, NULL, 'pending', 1.0, NULL)",
]


def test_a_version_3_ledger_is_migrated_in_place_keeping_its_books(ledger_url):
    engine = sa.create_engine(ledger_url.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as conn:
        for statement in V3:
            conn.exec_driver_sql(statement)
    engine.dispose()
    ledger = Ledger(ledger_url)
    with ledger.engine.connect() as conn:
        assert conn.execute(sa.select(schema_version.c.version)).scalar() == SCHEMA_VERSION
    assert ledger.accounts()[0] | {} == {"budget": "org", "period": "2026-11", "unit": "money", "limit": 5.0,
                                         "pending": 1.0, "posted": 2.0, "remaining": 2.0, "alerted": 0}
    (s,), _ = ledger.settle(["h-old"], 0.5, kind="settlement", payload={}, **IDS)  # the old hold settles normally
    assert s.first and ledger.account("org", "2026-11")["posted"] == 2.5
    assert ledger.expire_holds() == []  # a hold from before leases never expires on its own
    Ledger(ledger_url)  # reopening a migrated ledger changes nothing


V5 = [
    "CREATE TABLE aisched_schema (version INTEGER NOT NULL)",
    "CREATE TABLE aisched_budget_accounts (budget VARCHAR(200) NOT NULL, period VARCHAR(32) NOT NULL, "
    "limit_micros BIGINT NOT NULL, pending_micros BIGINT NOT NULL, posted_micros BIGINT NOT NULL, "
    "unit VARCHAR(16) NOT NULL DEFAULT 'money', alerted INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (budget, period))",
    "CREATE TABLE aisched_holds (id VARCHAR(36) NOT NULL PRIMARY KEY, budget VARCHAR(200) NOT NULL, period VARCHAR(32) NOT NULL, "
    "flow_run_id VARCHAR(64), task_run_id VARCHAR(64), principal VARCHAR(200), reserved_micros BIGINT NOT NULL, "
    "charged_micros BIGINT, status VARCHAR(16) NOT NULL, created_at FLOAT NOT NULL, settled_at FLOAT, "
    "unit VARCHAR(16) NOT NULL DEFAULT 'money', lease_until FLOAT)",
    "CREATE TABLE aisched_chain_head (id INTEGER NOT NULL PRIMARY KEY, seq BIGINT NOT NULL, hash VARCHAR(64) NOT NULL)",
    "INSERT INTO aisched_schema VALUES (5)",
    f"INSERT INTO aisched_chain_head VALUES (1, 0, '{'0' * 64}')",
    "INSERT INTO aisched_budget_accounts VALUES ('team', '2026-11', 5000000, 1500000, 0, 'money', 0)",
    "INSERT INTO aisched_budget_accounts VALUES ('team/a', '2026-11', 3000000, 1500000, 0, 'money', 0)",
    # one run's reservation on both accounts (one task run, one instant), and another run's, both pending
    "INSERT INTO aisched_holds VALUES ('h-team', 'team', '2026-11', 'f', 't1', 'p', 1000000, NULL, 'pending', 100.0, NULL, 'money', 4e9)",
    "INSERT INTO aisched_holds VALUES ('h-a', 'team/a', '2026-11', 'f', 't1', 'p', 1000000, NULL, 'pending', 100.0, NULL, 'money', 4e9)",
    "INSERT INTO aisched_holds VALUES ('h2-team', 'team', '2026-11', 'f', 't2', 'p', 500000, NULL, 'pending', 101.0, NULL, 'money', 4e9)",
    "INSERT INTO aisched_holds VALUES ('h2-a', 'team/a', '2026-11', 'f', 't2', 'p', 500000, NULL, 'pending', 101.0, NULL, 'money', 4e9)",
]


def test_a_version_5_ledger_keeps_each_reservations_pending_holds_together(ledger_url):
    engine = sa.create_engine(ledger_url.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as conn:
        for statement in V5:
            conn.exec_driver_sql(statement)
    engine.dispose()
    ledger = Ledger(ledger_url)
    groups = {h["hold"]: h["group"] for h in ledger.history()}
    assert groups["h-team"] == groups["h-a"] != groups["h2-team"] == groups["h2-a"]
    out, _ = ledger.settle(["h-a"], 0.25, kind="settlement", payload={}, **IDS)  # settles the run's hold on team too
    assert sorted((s.hold_id, s.charged) for s in out) == [("h-a", 0.25), ("h-team", 0.25)]
    with ledger.engine.begin() as conn:  # the other run's process died long ago
        conn.exec_driver_sql("UPDATE aisched_holds SET lease_until = 1.0 WHERE id IN ('h2-team', 'h2-a')")
    assert sorted(ledger.expire_holds()) == ["h2-a", "h2-team"]
    assert ledger.account("team", P)["posted"] == ledger.account("team/a", P)["posted"] == 0.75
    with ledger.engine.connect() as conn:
        assert conn.execute(sa.select(schema_version.c.version)).scalar() == SCHEMA_VERSION
