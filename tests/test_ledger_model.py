"""The ledger against a plain-Python model of the books, driven by hypothesis, on SQLite and Postgres.

In the style of TigerBeetle's simulator: random sequences of reservations,
settlements (voids, charges within and above the hold), renewals, leases
running out, expiry sweeps, process crashes (between writes and in the middle
of one) and operator limit changes (newer and stale versions), with every
invariant checked after every step:

- no overspend: a reservation is granted exactly when it fits the limit in force; posted plus held
  never exceeds the limit, except what was already committed when an operator lowered it; posted never
  passes a limit the books show (after a cut below what runs hold, a charge posts what the limit has
  left and the rest is written off), unless it was already past it when the limit was cut;
- a parent's posted and held equal its children's (team = flow-0 + flow-1), to the micro-unit;
- each account's posted equals its holds' charges and the charges in the evidence, to the micro-unit,
  and the true sum of what was charged within one micro-unit;
- every hold ends once (one settlement or expiry in the evidence), and the evidence chain verifies.
"""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from aisched_prefect import Ledger
from aisched_prefect.ledger import BudgetExceeded, BudgetLine, holds, metadata, to_micros
from aisched_prefect.ledger.budget import reserve_op
from aisched_prefect.ledger.limits import checked_lines

pytestmark = pytest.mark.slow  # the books against a model, thousands of steps on each database: a minute or more

F = 10**9  # femto-units per micro-unit
P = "2026-11"
TEAM, FLOWS = "team", ("team/flow-0", "team/flow-1")
ACCOUNTS = (TEAM, *FLOWS)
IDS = {"flow_run_id": "model", "task_run_id": None, "principal": "model"}
# Amounts in 1e-9 of a unit: fractions of a micro-unit that rounding alone would drift on, tiny ones, large ones.
NANOS = st.one_of(st.sampled_from([400, 1_500, 2_700, 333_333_333]), st.integers(0, 3_000), st.integers(0, 1_500_000_000))


class Killed(BaseException):
    """The process died in the middle of a write."""


class Group:
    """One reservation in the model: one hold on the team and one on a flow, of the same size."""

    def __init__(self, ids: list[str], flow: str, reserved: int) -> None:
        self.ids, self.flow, self.reserved = ids, flow, reserved
        self.status = "pending"  # pending | posted | voided | expired
        self.run_out = False  # its lease ran out (the holder stopped renewing)
        self.orphan = False  # its process crashed: nobody will settle or renew it


class LedgerModel(RuleBasedStateMachine):
    url_of: staticmethod  # set by the test: a fresh, empty ledger URL per example

    def __init__(self) -> None:
        super().__init__()
        self.url = type(self).url_of()
        self.ledger = Ledger(self.url, lease_seconds=3600)
        self.version = 0
        self.limit: dict[str, int] = {}
        self.cap: dict[str, int] = {}  # what posted + held may reach: the limit, or more if it was lowered below use
        self.posted_cap: dict[str, int] = {}  # what posted may reach: the limit, or what was posted when it was cut
        self.pending = dict.fromkeys(ACCOUNTS, 0)
        self.true = dict.fromkeys(ACCOUNTS, 0)  # femto-units actually charged
        self.groups: list[Group] = []

    def teardown(self) -> None:
        self.ledger.close()

    # -- helpers ---------------------------------------------------------------------------
    def _apply(self, limits: dict[str, int], version: int) -> None:
        """The operator applies a whole configuration (every account's limit) as version `version`."""
        applied = self.ledger.apply_limits([BudgetLine(budget=b, period=P, limit=m / 1e6) for b, m in limits.items()],
                                           version, by="operator")
        if version < self.version:  # an older version than the one in force: changes nothing
            assert applied.stale == sorted(limits) and applied.changed == []
            return
        assert applied.changed == sorted(b for b in limits if self.limit.get(b) != limits[b])
        self.version = version
        posted = self._posted()
        for b, m in limits.items():
            self.cap[b] = max(m, self.pending[b] + posted[b])
            self.posted_cap[b] = max(m, posted[b])
            self.limit[b] = m

    def _posted(self) -> dict[str, int]:
        posted = dict.fromkeys(ACCOUNTS, 0)
        posted.update({a["budget"]: to_micros(a["posted"]) for a in self.ledger.accounts()})
        return posted

    def _room(self, g: Group, posted: dict[str, int]) -> int:
        """What a charge on this group may post (micro-units): within its hold, and no account past its limit."""
        free = {b: self.limit[b] - self.pending[b] - posted[b] for b in (TEAM, g.flow)}
        return min(min(g.reserved + max(free[b], 0), max(self.limit[b] - posted[b], 0)) for b in (TEAM, g.flow))

    def _expire(self, group: Group, posted: dict[str, int]) -> None:
        """Charged in full, as far as the limits (perhaps cut since) have room; `posted` is kept up to date."""
        room = min(group.reserved, self._room(group, posted))
        group.status = "expired"
        for b in (TEAM, group.flow):
            self.pending[b] -= group.reserved
            self.true[b] += room * F
            posted[b] += room

    def _lines(self, flow: str, nanos: int, stale: int) -> list[BudgetLine]:
        # The lines a flow holds: from the version in force, an older one, or none (their limits never count).
        version = {0: self.version, 1: max(self.version - 1, 0), 2: None}[stale]
        return [BudgetLine(budget=b, period=P, limit=9.0, amount=nanos / 1e9, config_version=version) for b in (TEAM, flow)]

    # -- rules -----------------------------------------------------------------------------
    @initialize()
    def configure(self) -> None:
        self._apply({TEAM: 3_000_000, FLOWS[0]: 2_000_000, FLOWS[1]: 2_000_000}, 1)

    @rule(flow=st.sampled_from(FLOWS), nanos=NANOS, stale=st.integers(0, 2))
    def reserve(self, flow: str, nanos: int, stale: int) -> None:
        want = -(-nanos * 10**6 // F)  # holds round up to the micro-unit
        posted = self._posted()
        free = {b: self.limit[b] - self.pending[b] - posted[b] for b in (TEAM, flow)}  # expiry may free room (a cut limit caps it)
        refused = None
        for b in (TEAM, flow):  # in key order, as the ledger takes them
            if want > free[b]:  # a reservation that needs the room first expires what ran out on the account
                for g in sorted(self.groups, key=lambda g: g.ids[0]):  # the ledger takes them in id order
                    if g.status == "pending" and g.run_out and b in (TEAM, g.flow):
                        self._expire(g, posted)
                free = {k: self.limit[k] - self.pending[k] - posted[k] for k in (TEAM, flow)}
                if want > free[b]:
                    refused = b
                    break
        try:
            held, record = self.ledger.reserve(self._lines(flow, nanos, stale), kind="admission", payload={}, **IDS)
        except BudgetExceeded as exc:
            assert refused == exc.budget, f"refused on {exc.budget}, the model says {refused}"
            return
        assert refused is None, f"granted, but {refused} has no room"
        assert [h.budget for h in held] == [TEAM, flow] and {to_micros(h.reserved) for h in held} == {want}
        self.groups.append(Group([h.id for h in held], flow, want))
        self.pending[TEAM] += want
        self.pending[flow] += want

    @precondition(lambda self: any(not g.orphan for g in self.groups))
    @rule(pick=st.integers(0, 10**6), nanos=st.one_of(st.none(), NANOS, st.integers(0, 4_000_000_000)),
          by_flow_hold=st.booleans())
    def settle(self, pick: int, nanos: int | None, by_flow_hold: bool) -> None:
        mine = [g for g in self.groups if not g.orphan]
        self._settle(mine[pick % len(mine)], nanos, by_flow_hold)

    @rule(flow=st.sampled_from(FLOWS), nanos=st.sampled_from([400, 1_400, 700, 2_500]), runs=st.integers(2, 6))
    def many_small_runs(self, flow: str, nanos: int, runs: int) -> None:
        """Model calls charging fractions of a micro-unit, one after another (rounding each would drift)."""
        for _ in range(runs):
            before = len(self.groups)
            self.reserve(flow, nanos, 0)
            if len(self.groups) == before:
                return
            self._settle(self.groups[-1], nanos, False)

    def _settle(self, g: Group, nanos: int | None, by_flow_hold: bool) -> None:
        posted = self._posted()
        room = self._room(g, posted)
        actual = None if nanos is None else nanos / 1e9
        out, record = self.ledger.settle([g.ids[1] if by_flow_hold else g.ids[0]], actual, kind="settlement",
                                         payload={}, **IDS)
        assert sorted(s.hold_id for s in out) == sorted(g.ids)  # the whole group, whichever hold was named
        if g.status != "pending":
            assert record is None and all(not s.first and s.status == g.status for s in out)
            return
        assert record is not None and all(s.first for s in out)
        for b in (TEAM, g.flow):
            self.pending[b] -= g.reserved
        if nanos is None:
            g.status = "voided"
            assert all(s.status == "voided" and s.charged == 0 for s in out)
            return
        g.status = "posted"
        charge = nanos * 10**6
        expected = min(charge, room * F)  # above the hold, or past a cut limit: what all have room for
        assert len({s.charged for s in out}) == 1  # one amount on every account of the run
        for s in out:
            covered = charge - round(s.uncovered * 10**15)
            assert covered <= charge and abs(covered - expected) < F, (expected, covered)
            self.true[s.budget] += covered

    @precondition(lambda self: any(not g.orphan for g in self.groups))
    @rule(pick=st.integers(0, 10**6))
    def renew(self, pick: int) -> None:
        mine = [g for g in self.groups if not g.orphan]
        g = mine[pick % len(mine)]
        renewed = self.ledger.renew([g.ids[pick % 2]])
        assert renewed == (set(g.ids) if g.status == "pending" and not g.run_out else set())

    @precondition(lambda self: any(g.status == "pending" and not g.run_out for g in self.groups))
    @rule(pick=st.integers(0, 10**6))
    def lease_runs_out(self, pick: int) -> None:
        live = [g for g in self.groups if g.status == "pending" and not g.run_out]
        g = live[pick % len(live)]
        with self.ledger.engine.begin() as conn:  # as if its holder stopped renewing long ago
            conn.execute(holds.update().where(holds.c.id.in_(g.ids)).values(lease_until=holds.c.lease_until - 10**7))
        g.run_out = True

    @rule()
    def sweep(self) -> None:
        gone = [g for g in self.groups if g.status == "pending" and g.run_out]
        posted = self._posted()
        assert sorted(self.ledger.expire_holds()) == sorted(i for g in gone for i in g.ids)
        for g in sorted(gone, key=lambda g: g.ids[0]):  # the sweep takes groups in id order (a group's id: its first hold's)
            self._expire(g, posted)

    @rule()
    def process_crash(self) -> None:
        """The process dies between writes: what it held stays pending until its lease runs out."""
        for g in self.groups:
            g.orphan = True
        self.ledger.close()
        self.ledger = Ledger(self.url, lease_seconds=3600)

    @rule(flow=st.sampled_from(FLOWS), nanos=NANOS)
    def crash_inside_a_write(self, flow: str, nanos: int) -> None:
        """The process dies in the middle of a reservation: nothing of it, or of what it looked at, is kept."""
        op = reserve_op(checked_lines(self._lines(flow, nanos, 0)), 3600.0, "admission", {}, IDS)

        def dying(w):
            try:
                op(w)
            except BudgetExceeded:
                pass
            raise Killed()

        with pytest.raises(Killed):
            self.ledger._write(dying)
        self.process_crash()

    @rule(account=st.sampled_from(ACCOUNTS), micros=st.integers(0, 4_000_000), stale=st.booleans())
    def operator_changes_a_limit(self, account: str, micros: int, stale: bool) -> None:
        self._apply({**self.limit, account: micros}, self.version - 1 if stale else self.version + 1)

    @precondition(lambda self: any(self.pending[b] > 0 for b in ACCOUNTS))
    @rule(account=st.sampled_from(ACCOUNTS), keep=st.integers(0, 100))
    def operator_cuts_below_what_runs_hold(self, account: str, keep: int) -> None:
        """The cut the books must survive: a limit lowered below posted plus held, while the runs still hold."""
        held = [b for b in ACCOUNTS if self.pending[b] > 0]
        b = account if account in held else held[0]
        posted = self._posted()[b]
        self._apply({**self.limit, b: posted + self.pending[b] * keep // 100}, self.version + 1)

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def books_balance(self) -> None:
        accounts = {a["budget"]: a for a in self.ledger.accounts()}
        with self.ledger.engine.connect() as conn:
            rows = conn.execute(sa.select(holds.c.id, holds.c.budget, holds.c.status, holds.c.charged_micros,
                                          holds.c.reserved_micros, holds.c.group_id)).all()
        records = self.ledger.records()
        ended: dict[str, int] = {}
        by_evidence = dict.fromkeys(ACCOUNTS, 0)
        for r in records:
            if r.kind == "settlement":
                for s in r.payload["settlements"]:
                    if s["first"]:
                        ended[s["hold_id"]] = ended.get(s["hold_id"], 0) + 1
                        by_evidence[s["budget"]] += to_micros(s["charged"])
            elif r.kind == "hold-expired":
                for h in r.payload["holds"]:
                    ended[h["id"]] = ended.get(h["id"], 0) + 1
                    by_evidence[r.payload["budget"]] += to_micros(h["charged"])
        status = {r.id: r.status for r in rows}
        for g in self.groups:
            assert {status[i] for i in g.ids} == {g.status}, "a group's holds ended apart"
        assert all(n == 1 for n in ended.values()) and set(ended) == {r.id for r in rows if r.status != "pending"}
        for b in ACCOUNTS:
            a = accounts.get(b, {"pending": 0.0, "posted": 0.0, "limit": self.limit[b] / 1e6})
            pending, posted = to_micros(a["pending"]), to_micros(a["posted"])
            assert pending == self.pending[b] == sum(r.reserved_micros for r in rows if r.budget == b and r.status == "pending")
            assert posted == sum(r.charged_micros or 0 for r in rows if r.budget == b) == by_evidence[b]
            assert abs(posted * F - self.true[b]) < F, f"{b}: posted {posted}, charged {self.true[b] / F}"
            assert to_micros(a["limit"]) == self.limit[b]
            self.cap[b] = max(self.limit[b], min(self.cap[b], pending + posted))
            assert pending + posted <= self.cap[b], f"{b} overspent"
            self.posted_cap[b] = max(self.limit[b], min(self.posted_cap[b], posted))
            assert posted <= self.posted_cap[b], f"{b} posted {posted} past its limit {self.limit[b]}"
        for key in ("pending", "posted"):
            team = to_micros(accounts.get(TEAM, {key: 0.0})[key])
            assert team == sum(to_micros(accounts.get(f, {key: 0.0})[key]) for f in FLOWS), f"team {key} != flows'"
        assert self.ledger.verify().ok


MODEL_SETTINGS = settings(max_examples=15, stateful_step_count=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _run(url_of) -> None:
    machine = type("LedgerModelRun", (LedgerModel,), {"url_of": staticmethod(url_of)})
    run_state_machine_as_test(machine, settings=MODEL_SETTINGS)


def test_the_books_match_the_model_on_sqlite(tmp_path):
    _run(lambda: f"sqlite:///{tmp_path / uuid.uuid4().hex}.db")


def test_the_books_match_the_model_on_postgres(postgres_url):
    # Commits need not wait for the disk here: a crash of this test's processes, not of the server, is modelled.
    url = postgres_url + "%20-csynchronous_commit%3Doff"
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))

    def fresh() -> str:  # an empty ledger in the test's own schema for each example
        with engine.begin() as conn:
            metadata.drop_all(conn)
        return url

    try:
        _run(fresh)
    finally:
        engine.dispose()
