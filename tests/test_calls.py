"""The call book replicas share: who owns a call, and what a replica that failed or stalled leaves behind.

Units over a real ledger database (SQLite and Postgres), without a control plane: two CallBooks are two replicas.
"""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from aisched_prefect import Ledger
from aisched_prefect.control.calls import CallBook, CallTakenOver, calls
from aisched_prefect.ledger import BudgetLine

IDS = {"flow_run_id": "f", "task_run_id": "t", "principal": "team-a/x"}


def _line() -> BudgetLine:
    return BudgetLine(budget="team-a", period="2026-12", limit=10.0, amount=1.0)


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"  # the Postgres database is shared by every test and run


def _stall(book: CallBook) -> None:
    """The replica's heartbeat is older than its peers wait for: they take its calls over."""
    book.alive_seconds = 0.0


def test_a_stalled_replica_cannot_file_an_admission_for_a_call_another_took_over(ledger_url):
    """Replica a's heartbeat stalled while it admitted; b took the call over. a's holds roll back with its filing,
    so only one replica ever holds budget for the call."""
    ledger = Ledger(ledger_url)
    a, b = CallBook(ledger, _name("a"), "http://a"), CallBook(ledger, _name("b"), "http://b")
    key = _name("t")
    assert a.claim(key)[0] == "new"
    _stall(b)
    assert b.claim(key)[0] == "takeover"
    with pytest.raises(CallTakenOver, match="taken over by another replica"):
        ledger.reserve([_line()], kind="admission", payload={}, **IDS,
                       also=lambda conn, held, rec: a.admitted(key, {"id": str(rec.seq)}, conn))
    assert ledger.account("team-a", "2026-12") is None and ledger.records() == []  # nothing was ever held
    held, rec = ledger.reserve([_line()], kind="admission", payload={}, **IDS,
                               also=lambda conn, held, rec: b.admitted(key, {"id": str(rec.seq)}, conn))
    assert ledger.account("team-a", "2026-12")["pending"] == 1.0


def test_an_admitted_call_that_failed_on_its_replica_is_continued_not_admitted_again(ledger_url):
    """A failure after the holds were filed: the call is left for a takeover (by any replica, the same one included),
    which finds its admission; a call that failed before anything was decided is forgotten."""
    ledger = Ledger(ledger_url)
    a = CallBook(ledger, _name("a"), "http://a")
    bad, key = _name("t"), _name("t")
    assert a.claim(bad)[0] == "new"
    a.release(bad)  # bad input: nothing decided
    assert a.claim(bad)[0] == "new"
    assert a.claim(key)[0] == "new"
    a.admitted(key, {"id": "7"})
    a.release(key)
    claim, row = a.claim(key)
    assert claim == "takeover" and row.admission == {"id": "7"}
    with ledger.engine.connect() as conn:
        assert conn.execute(sa.select(calls.c.replica).where(calls.c.key == key)).scalar_one() == a.replica


def test_a_task_run_belongs_to_its_first_caller_and_keys_name_the_caller(ledger_url):
    """Task run ids are readable in Prefect: the first principal to call under one owns it (on every replica), and
    two callers' keys for the same task run and attempt never meet, so a stored reply goes back only to its caller."""
    from aisched_prefect.control.calls import call_key

    ledger = Ledger(ledger_url)
    a, b = CallBook(ledger, _name("a"), "http://a"), CallBook(ledger, _name("b"), "http://b")
    run = _name("tr")
    assert a.task_owner(run, "auth:team-b/etl") == "auth:team-b/etl"
    assert b.task_owner(run, "auth:team-a/nightly") == "auth:team-b/etl"  # another replica, from the database
    assert call_key("auth:team-a/nightly", run, 2) != call_key("auth:team-b/etl", run, 2)
    assert call_key("x:p", run, 1) == call_key("x:p", run, 1) != call_key("x:p", run, 1, "7")
    assert len(call_key("a" * 400, "t" * 64, 99, "9" * 20)) <= 300  # fits the key column, whatever the names
