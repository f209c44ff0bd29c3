"""The ledger on SQLite and Postgres: holds, settlement, and the evidence chain."""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa

from aisched_prefect import Ledger
from aisched_prefect.ledger import BudgetExceeded, BudgetLine, evidence

IDS = {"flow_run_id": "f", "task_run_id": "t", "principal": "team-a/x"}


def line(limit: float = 1.0) -> BudgetLine:
    return BudgetLine(budget="team-a", period="2026-11", limit=limit)


def test_reserve_settle_exactly_once(ledger_url):
    ledger = Ledger(ledger_url)
    (hold,), rec = ledger.reserve([line()], 0.4, kind="admission", payload={"x": 1}, **IDS)
    assert hold.remaining_before == 1.0 and hold.remaining_after == pytest.approx(0.6)
    (s,), rec2 = ledger.settle([hold.id], 0.25, kind="settlement", payload={}, **IDS)
    assert s.first and s.charged == 0.25 and s.released == pytest.approx(0.15)
    (again,), none = ledger.settle([hold.id], 0.25, kind="settlement", payload={}, **IDS)
    assert not again.first and none is None  # idempotent: no second charge, no second record
    assert ledger.account("team-a", "2026-11") == {"limit": 1.0, "pending": 0.0, "posted": 0.25, "remaining": 0.75}
    assert [r.kind for r in ledger.records()] == ["admission", "settlement"]


def test_hold_past_the_limit_is_refused_and_records_nothing(ledger_url):
    ledger = Ledger(ledger_url)
    ledger.reserve([line()], 0.7, kind="admission", payload={}, **IDS)
    before = ledger.records()
    assert [r.kind for r in before] == ["admission", "budget-alert"]  # 70% used crossed 50%
    with pytest.raises(BudgetExceeded, match="0.3000 left of 1.00"):
        ledger.reserve([line()], 0.4, kind="admission", payload={}, **IDS)
    assert ledger.records() == before


def test_charge_above_the_hold_never_passes_the_limit(ledger_url):
    ledger = Ledger(ledger_url)
    (hold,), _ = ledger.reserve([line()], 0.5, kind="admission", payload={}, **IDS)
    ledger.reserve([line()], 0.3, kind="admission", payload={}, **IDS)
    (s,), _ = ledger.settle([hold.id], 0.9, kind="settlement", payload={}, **IDS)
    assert s.charged == pytest.approx(0.7) and s.uncovered == pytest.approx(0.2)
    acct = ledger.account("team-a", "2026-11")
    assert acct["posted"] + acct["pending"] <= acct["limit"]


def test_concurrent_reservations_never_overspend(ledger_url):
    ledger = Ledger(ledger_url)
    won, lost = [], []

    def worker():
        for _ in range(10):
            try:
                ledger.reserve([line(1.0)], 0.07, kind="admission", payload={}, **IDS)
                won.append(1)
            except BudgetExceeded:
                lost.append(1)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 14 and len(lost) == 66  # floor(1.0 / 0.07) holds fit, exactly
    acct = ledger.account("team-a", "2026-11")
    assert acct["pending"] == pytest.approx(0.98) and ledger.verify().ok
    assert sum(r.kind == "admission" for r in ledger.records()) == 14


def _tamper(ledger: Ledger, sql: str) -> None:
    with ledger.engine.begin() as conn:
        conn.execute(sa.text(sql))


@pytest.mark.parametrize(
    "sql, problem",
    [
        ("UPDATE aisched_evidence SET principal = 'mallory' WHERE seq = 2", "edited"),
        ("DELETE FROM aisched_evidence WHERE seq = 2", "deleted or reordered"),
        ("DELETE FROM aisched_evidence WHERE seq = 3", "truncated"),
        ("UPDATE aisched_evidence SET seq = CASE seq WHEN 1 THEN 2 ELSE 1 END WHERE seq IN (1, 2)", "reordered"),
    ],
)
def test_any_tampering_with_the_log_is_detected(ledger_url, sql, problem):
    ledger = Ledger(ledger_url)
    for i in range(3):
        ledger.record("admission", {"i": i}, **IDS)
    assert ledger.verify().ok
    if "CASE" in sql:  # swap two records' positions without a unique-key clash
        _tamper(ledger, "UPDATE aisched_evidence SET seq = seq + 100 WHERE seq IN (1, 2)")
        sql = "UPDATE aisched_evidence SET seq = CASE seq WHEN 101 THEN 2 ELSE 1 END WHERE seq IN (101, 102)"
    _tamper(ledger, sql)
    report = ledger.verify()
    assert not report.ok and problem in report.problem


def test_schema_is_created_once_and_reopened(ledger_url):
    Ledger(ledger_url).record("admission", {}, **IDS)
    reopened = Ledger(ledger_url)
    reopened.record("settlement", {}, **IDS)
    assert [r.seq for r in reopened.records()] == [1, 2] and reopened.verify().ok
    with reopened.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(evidence)).scalar() == 2


def test_group_commit_keeps_each_write_all_or_nothing(ledger_url):
    """Writes queued together commit together; a refused one leaves no trace and blocks no other."""
    ledger = Ledger(ledger_url)
    (first,), _ = ledger.reserve([line(1.0)], 0.5, kind="admission", payload={}, **IDS)
    results: dict[int, object] = {}

    def reserve(i: int, amount: float) -> None:
        try:
            results[i] = ledger.reserve([line(1.0)], amount, kind="admission", payload={"i": i}, **IDS)[0][0]
        except BudgetExceeded as exc:
            results[i] = exc

    def settle() -> None:
        results[99] = ledger.settle([first.id], 0.1, kind="settlement", payload={}, **IDS)[0][0]

    with ledger._write_lock:  # hold the writer so that every call below lands in one batch
        threads = [threading.Thread(target=reserve, args=(i, a)) for i, a in enumerate([0.3, 0.9, 0.2, 0.2])]
        threads.append(threading.Thread(target=settle))
        for t in threads:
            t.start()
        while len(ledger._queue) < len(threads):
            threading.Event().wait(0.01)
    for t in threads:
        t.join()
    assert isinstance(results[1], BudgetExceeded)  # 0.9 never fits
    assert results[99].first and results[99].charged == pytest.approx(0.1)
    acct = ledger.account("team-a", "2026-11")
    assert acct["posted"] + acct["pending"] <= acct["limit"]
    granted = [r for i, r in results.items() if i != 99 and not isinstance(r, BudgetExceeded)]
    assert acct["pending"] == pytest.approx(sum(h.reserved for h in granted))
    assert ledger.verify().ok
    kinds = [r.kind for r in ledger.records() if r.kind != "budget-alert"]
    assert kinds.count("admission") == 1 + len(granted) and kinds.count("settlement") == 1


def _side_table(ledger: Ledger, prefix: str, key: str, value: str) -> sa.Table:
    """A caller's own table beside the books (a name of its own: the Postgres database is shared by every run)."""
    import uuid

    table = sa.Table(f"{prefix}_{uuid.uuid4().hex[:8]}", sa.MetaData(), sa.Column(key, sa.String(64), primary_key=True),
                     sa.Column(value, sa.String(64)))
    table.create(ledger.engine)
    return table


def test_a_callers_row_commits_with_the_holds_or_not_at_all(ledger_url):
    """`reserve(also=...)`: the control plane files a call's admission beside its holds in one transaction, so a
    replica killed just after the holds were taken leaves its admission findable (not held twice by a takeover)."""
    ledger = Ledger(ledger_url)
    calls = _side_table(ledger, "calls", "key", "hold")
    try:
        (hold,), rec = ledger.reserve([line()], 0.4, kind="admission", payload={}, **IDS,
                                      also=lambda conn, held, rec: conn.execute(calls.insert().values(
                                          key=f"t/{rec.seq}", hold=held[0].id)))
        with ledger.engine.connect() as conn:
            assert conn.execute(sa.select(calls.c.key, calls.c.hold)).all() == [(f"t/{rec.seq}", hold.id)]

        def killed(conn, held, rec):
            conn.execute(calls.insert().values(key="t/lost", hold=held[0].id))
            raise RuntimeError("the replica died here")

        with pytest.raises(RuntimeError, match="the replica died here"):
            ledger.reserve([line()], 0.3, kind="admission", payload={}, **IDS, also=killed)
        with ledger.engine.connect() as conn:
            assert conn.execute(sa.select(calls.c.key)).scalars().all() == [f"t/{rec.seq}"]
        assert ledger.account("team-a", "2026-11")["pending"] == pytest.approx(0.4)  # the second hold never was
        assert [r.kind for r in ledger.records()] == ["admission"] and ledger.verify().ok
    finally:
        calls.drop(ledger.engine)


def test_a_callers_row_moves_with_a_settlement_or_not_at_all(ledger_url):
    """`settle(also=...)`: a warm body's idle hold is settled and its row moved in one transaction, so neither
    stands without the other (a row that still says idle is settled again by whoever loads it: settling twice
    changes nothing)."""
    ledger = Ledger(ledger_url)
    rows = _side_table(ledger, "rows", "body", "state")
    try:
        (hold,), _ = ledger.reserve([line()], 0.4, kind="warm-hold", payload={}, **IDS,
                                    also=lambda conn, held, rec: conn.execute(rows.insert().values(body="b",
                                                                                                   state="idle")))

        def killed(conn):
            conn.execute(rows.update().values(state="ended"))
            raise RuntimeError("the replica died here")

        with pytest.raises(RuntimeError, match="the replica died here"):
            ledger.settle([hold.id], 0.1, kind="warm-idle", payload={}, **IDS, also=killed)
        with ledger.engine.connect() as conn:
            assert conn.execute(sa.select(rows.c.state)).scalars().all() == ["idle"]
        assert ledger.account("team-a", "2026-11")["pending"] == pytest.approx(0.4)  # still held
        ledger.settle([hold.id], 0.1, kind="warm-idle", payload={}, **IDS,
                      also=lambda conn: conn.execute(rows.update().values(state="ended")))
        with ledger.engine.connect() as conn:
            assert conn.execute(sa.select(rows.c.state)).scalars().all() == ["ended"]
        acct = ledger.account("team-a", "2026-11")
        assert acct["pending"] == pytest.approx(0.0) and acct["posted"] == pytest.approx(0.1)
        assert [r.kind for r in ledger.records()] == ["warm-hold", "warm-idle"] and ledger.verify().ok
        ledger.settle([], 0.1, kind="warm-idle", payload={}, **IDS,  # no holds (a budget of prices only)
                      also=lambda conn: conn.execute(rows.insert().values(body="c", state="ended")))
        with ledger.engine.connect() as conn:
            assert conn.execute(sa.select(rows.c.state).where(rows.c.body == "c")).scalar_one() == "ended"
    finally:
        rows.drop(ledger.engine)


def test_signed_checkpoints_catch_a_clean_truncation(ledger_url, tmp_path):
    """Truncate the tail and rewrite the head to match: the chain alone cannot tell, a signed checkpoint can."""
    from typer.testing import CliRunner

    from aisched_prefect.cli import app

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    cli = CliRunner()
    signer = Ed25519PrivateKey.generate()  # the control plane's key signs checkpoints (POST /v1/checkpoints)
    public = signer.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
    ledger = Ledger(ledger_url)
    for i in range(4):
        ledger.record("admission", {"i": i}, **IDS)
    ledger.checkpoint(signer)
    ok = cli.invoke(app, ["evidence", "verify", "--public-key", public, "--ledger", ledger_url])
    assert ok.exit_code == 0 and "intact" in ok.stdout
    third = ledger.records()[2]
    _tamper(ledger, "DELETE FROM aisched_evidence WHERE seq = 4")
    _tamper(ledger, f"UPDATE aisched_chain_head SET seq = 3, hash = '{third.hash}'")
    assert ledger.verify().ok  # a clean truncation: invisible to the chain alone
    caught = cli.invoke(app, ["evidence", "verify", "--public-key", public, "--ledger", ledger_url])
    assert caught.exit_code == 1 and "past the end of the log: truncated" in caught.stdout


def test_a_forged_checkpoint_is_detected(ledger_url, tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    ledger = Ledger(ledger_url)
    ledger.record("admission", {}, **IDS)
    mine, theirs = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    ledger.checkpoint(theirs)  # signed by a key the auditor does not hold
    report = ledger.verify(mine.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))
    assert not report.ok and "not signed by this key" in report.problem


def test_the_authority_state_checks_a_long_log_a_batch_at_a_time(ledger_url, monkeypatch):
    """A plane starting on a ledger of many records folds them a batch at a time (bounded memory), checks every one,
    and stops at one edited in a later batch, as when it read them all at once."""
    from aisched_prefect.control.authority import state as module
    from aisched_prefect.ledger import evidence

    monkeypatch.setattr(module, "READ_BATCH", 5)
    ledger = Ledger(ledger_url)
    first = ledger.records()[-1].seq if ledger.records() else 0
    for i in range(12):
        ledger.record("note", {"i": i}, **IDS)
    state = module.AuthorityState(Ledger(ledger_url))
    state.refresh()
    assert state.broken is None and state._seen == first + 12
    with ledger.engine.begin() as conn:
        conn.execute(evidence.update().where(evidence.c.seq == first + 8).values(payload='{"i": 99}'))
    again = module.AuthorityState(Ledger(ledger_url))
    again.refresh()
    assert again.broken is not None and f"record {first + 8} does not match its hash" in again.broken
    assert again._seen == first + 7


class _CountingLock:
    """The writer's lock, counting who takes it."""

    def __init__(self) -> None:
        self._lock, self.taken = threading.Lock(), 0

    def __enter__(self) -> None:
        self._lock.acquire()
        self.taken += 1

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def acquire(self, *args: object) -> bool:
        got = self._lock.acquire(*args)
        self.taken += bool(got)
        return got

    def release(self) -> None:
        self._lock.release()


def test_writes_committed_by_another_thread_do_not_each_take_the_writers_lock(ledger_url):
    """A batch's writes are woken by the thread that committed them: before, each of them took the writer's lock in
    turn only to find its write done (a convoy the next batch waited behind: 15 % of a busy plane's CPU)."""
    ledger = Ledger(ledger_url)
    counting = _CountingLock()
    ledger._commits.lock = counting
    n = 40
    threads = [threading.Thread(target=ledger.record, args=("note", {"i": i}), kwargs=IDS) for i in range(n)]
    with counting:  # hold the writer so that every write below lands in one batch
        for t in threads:
            t.start()
        while len(ledger._queue) < n:
            threading.Event().wait(0.01)
        before = counting.taken
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert counting.taken - before == 1, f"the writer's lock was taken {counting.taken - before} times for one batch"
    assert sorted(r.payload["i"] for r in ledger.records() if r.kind == "note") == list(range(n))
    assert ledger.verify().ok


class _Interrupted(BaseException):
    pass


def test_a_write_interrupted_while_it_leads_hands_the_lead_on(ledger_url):
    """The thread committing a batch is interrupted: its writes fail, and later writes still commit (none waits for
    a leader that is gone)."""
    ledger = Ledger(ledger_url)

    def interrupted(_batch: object) -> None:
        raise _Interrupted()

    with pytest.raises(_Interrupted):
        ledger._write(interrupted)
    done: list[object] = []
    t = threading.Thread(target=lambda: done.append(ledger.record("note", {"after": True}, **IDS)))
    t.start()
    t.join(timeout=60)
    assert done and done[0].kind == "note"
