"""The ledger's Postgres connections cut under load (`pg_terminate_backend`, as a restart or failover does):
every reservation and settlement still succeeds, nothing is written twice, and the books balance. A write
whose connection dropped while it committed is read back, not run twice; one that cannot reach the database
at all fails with `LedgerUnavailable`, naming the cause."""

from __future__ import annotations

import threading
import uuid

import pytest
import sqlalchemy as sa

from aisched_prefect import Ledger
from aisched_prefect.errors import LedgerUnavailable
from aisched_prefect.ledger import BudgetLine, holds
from aisched_prefect.ledger.commit import GroupCommit

P = "2026-11"
CUTS = 6


def _lines(i: int) -> list[BudgetLine]:
    return [BudgetLine(budget="team", period=P, limit=1e6, amount=1.0),
            BudgetLine(budget=f"team/flow-{i % 2}", period=P, limit=1e6, amount=1.0)]


def _named(url: str, app: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}application_name={app}"


def _check_books(ledger: Ledger, reserved: int, settled: int) -> None:
    """Each run is in the books once: its holds, its admission and its settlement; posted is what was charged."""
    with ledger.engine.connect() as conn:
        rows = conn.execute(sa.select(holds)).all()
    records = ledger.records()
    assert len(rows) == 2 * reserved, "a reservation was written twice, or lost"
    assert sum(r.kind == "admission" for r in records) == reserved
    assert sum(r.kind == "settlement" for r in records) == settled == reserved
    assert {r.status for r in rows} == {"posted"}
    books = {a["budget"]: a for a in ledger.accounts()}
    for budget, acct in books.items():
        assert acct["pending"] == 0
        assert round(acct["posted"] * 1e6) == sum(r.charged_micros for r in rows if r.budget == budget)
    flows = sum(books[f]["posted"] for f in ("team/flow-0", "team/flow-1") if f in books)
    assert books["team"]["posted"] == pytest.approx(flows)
    assert ledger.verify().ok


@pytest.mark.parametrize("threads", [1, 4], ids=["one-writer", "four-writers"])
def test_connections_cut_under_load_fail_no_write(postgres_url, threads):
    """One writer: each transaction is one write (nothing else in its batch to run it again for it); four: the
    group commit's batches are cut too."""
    app = f"aisched-cut-{uuid.uuid4().hex[:8]}"
    ledger = Ledger(_named(postgres_url, app))
    killer = sa.create_engine(postgres_url.replace("postgresql://", "postgresql+psycopg://", 1))
    done = threading.Event()
    progress = threading.Condition()
    counts = {"reserved": 0, "settled": 0}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        while not done.is_set():
            try:
                held, _ = ledger.reserve(_lines(i), kind="admission", payload={"worker": i}, flow_run_id="f",
                                         task_run_id=f"t-{i}", principal="team-a/x")
                with progress:
                    counts["reserved"] += 1
                ledger.settle([held[0].id], 0.5, kind="settlement", payload={}, flow_run_id="f",
                              task_run_id=f"t-{i}", principal="team-a/x")
                with progress:
                    counts["settled"] += 1
                    progress.notify_all()
            except BaseException as exc:  # any failure is the test's failure
                errors.append(exc)
                done.set()

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    cut = 0
    try:
        while cut < CUTS and not errors:
            with progress:  # each cut lands while writes run, after the last one's were answered
                seen = counts["settled"]
                assert progress.wait_for(lambda: counts["settled"] >= seen + threads or errors, timeout=120)
            with killer.connect() as conn:
                n = conn.execute(sa.text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                         "WHERE application_name = :app AND pid <> pg_backend_pid()"), {"app": app}).scalar()
            cut += bool(n)
        with progress:  # and the writes go on after the last cut
            seen = counts["settled"]
            progress.wait_for(lambda: counts["settled"] >= seen + threads or errors, timeout=120)
    finally:
        done.set()
        for t in workers:
            t.join()
        killer.dispose()
    try:
        assert errors == [], f"a write failed: {errors[0]!r}"
        assert cut == CUTS and ledger._commits.retries > 0, "the cuts should have dropped connections under writes"
        _check_books(ledger, counts["reserved"], counts["settled"])
    finally:
        ledger.close()


@pytest.mark.parametrize("kept", [True, False], ids=["committed", "rolled-back"])
def test_a_commit_whose_connection_dropped_is_written_once(postgres_url, monkeypatch, kept):
    """The connection drops as COMMIT runs: whether or not it was kept, the run is in the books exactly once."""
    import psycopg

    ledger = Ledger(postgres_url)
    real = GroupCommit._commit_raw
    dropped = []

    def commit(raw):
        if not dropped:
            dropped.append(True)
            real(raw) if kept else raw.rollback()
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        real(raw)

    monkeypatch.setattr(GroupCommit, "_commit_raw", staticmethod(commit))
    try:
        held, record = ledger.reserve(_lines(0), kind="admission", payload={}, flow_run_id="f", task_run_id="t",
                                      principal="team-a/x")
        ledger.settle([held[0].id], 0.5, kind="settlement", payload={}, flow_run_id="f", task_run_id="t",
                      principal="team-a/x")
        assert dropped and [r.seq for r in ledger.records() if r.kind == "admission"] == [record.seq]
        _check_books(ledger, 1, 1)
    finally:
        ledger.close()


def test_a_database_that_does_not_answer_is_named_with_its_cause(postgres_url):
    """Nothing to retry into: the write fails with LedgerUnavailable (the plane's 503), the cause named."""
    ledger = Ledger(postgres_url)
    ledger._commits.close()
    ledger._commits.engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    try:
        with pytest.raises(LedgerUnavailable, match=r"OperationalError: .*Fix: check that the database is up") as info:
            ledger.record("note", {})
        assert info.value.status == 503
    finally:
        ledger._commits.engine.dispose()
        ledger.close()


def test_a_database_failure_leaves_the_plane_as_a_503_with_its_cause():
    """Whatever database error reaches the HTTP layer answers 503 naming it, not a bare Internal Server Error."""
    import psycopg
    from fastapi.testclient import TestClient

    from aisched_prefect.control.http.app import build_app

    class Credentials:  # all the route reaches: the credential check, which reads the log; the database is gone
        def authenticate(self, *_):
            raise sa.exc.OperationalError("SELECT", {}, psycopg.OperationalError(
                "terminating connection due to administrator command"))

    class Plane:
        credentials = Credentials()

    with TestClient(build_app(Plane()), raise_server_exceptions=False) as client:
        resp = client.get("/v1/whoami", headers={"authorization": "Bearer x"})
    assert resp.status_code == 503
    assert "OperationalError: terminating connection due to administrator command" in resp.json()["error"]
    assert "check that the database is up" in resp.json()["fix"]


def test_a_database_refusal_that_is_not_an_outage_still_names_its_cause():
    import psycopg
    from fastapi.testclient import TestClient

    from aisched_prefect.control.http.app import build_app

    class Credentials:
        def authenticate(self, *_):
            raise psycopg.errors.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes")

    class Plane:
        credentials = Credentials()

    with TestClient(build_app(Plane()), raise_server_exceptions=False) as client:
        resp = client.get("/v1/whoami", headers={"authorization": "Bearer x"})
    assert resp.status_code == 500 and "DataError: PostgreSQL text fields cannot contain NUL" in resp.json()["error"]
