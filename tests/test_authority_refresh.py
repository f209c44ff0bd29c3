"""Admissions that refresh the authority state at once share a read of the log, and none returns a state older than
the log was when it asked (a revocation committed before an admission is always seen by it)."""

from __future__ import annotations

import threading

import pytest

from aisched_prefect import Ledger
from aisched_prefect.control.authority.state import AuthorityState

THREADS = 16


class CountingLock:
    """The state's lock, counting who came for it (each has stamped when it asked before it does)."""

    def __init__(self, everyone_waits: threading.Event, everyone: int = THREADS) -> None:
        self.lock = threading.Lock()
        self.everyone = everyone
        self.came = 0
        self.count_lock = threading.Lock()
        self.everyone_waits = everyone_waits

    def __enter__(self):
        with self.count_lock:
            self.came += 1
            if self.came == self.everyone:
                self.everyone_waits.set()
        self.lock.acquire()
        return self

    def __exit__(self, *exc):
        self.lock.release()


@pytest.fixture
def ledger(tmp_path):
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    for i in range(5):
        ledger.record("settlement", {"n": i}, flow_run_id="f", task_run_id=f"t{i}")
    yield ledger
    ledger.close()


def _counting_reads(ledger: Ledger, first_read_waits_for: threading.Event | None = None) -> list[int]:
    reads = [0]
    connect = ledger.reader.connect

    def counted():
        reads[0] += 1
        if reads[0] == 1 and first_read_waits_for is not None:
            assert first_read_waits_for.wait(30), "the other refreshes never came"
        return connect()

    ledger.reader.connect = counted
    return reads


def test_refreshes_that_wait_for_one_another_share_the_next_read(ledger):
    state = AuthorityState(ledger)
    everyone_waits = threading.Event()
    state._lock = CountingLock(everyone_waits)
    reads = _counting_reads(ledger, first_read_waits_for=everyone_waits)
    ledger.record("revocation", {"grant": "g1", "authority": "team", "by": "op", "reason": "incident"})
    snaps = []
    threads = [threading.Thread(target=lambda: snaps.append(state.refresh())) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(snaps) == THREADS and all(("team", "g1") in s.revoked for s in snaps)
    # The first read began before the others asked; the second began after all of them did and serves them all.
    assert reads[0] == 2, reads[0]


def test_a_refresh_asked_after_a_revocation_was_committed_sees_it_though_an_older_read_ends_after_it_asked(ledger):
    state = AuthorityState(ledger)
    state.refresh()
    read_done, release, later_waits = threading.Event(), threading.Event(), threading.Event()
    lock = CountingLock(later_waits, everyone=2)  # the older refresh, then the later one
    state._lock = lock
    rows_after = state._rows_after

    def held(seen, last):  # the older refresh has read the log (without g2) and still holds the lock
        read_done.set()
        assert release.wait(30)
        return rows_after(seen, last)

    state._rows_after = held
    older = threading.Thread(target=state.refresh)
    older.start()
    assert read_done.wait(30)
    state._rows_after = rows_after
    ledger.record("revocation", {"grant": "g2", "authority": "team", "by": "op", "reason": "incident"})
    got = []
    later = threading.Thread(target=lambda: got.append(state.refresh()))  # asked after the commit
    later.start()
    assert later_waits.wait(30)  # it has asked, and waits for the lock the older refresh holds
    release.set()
    older.join(30)
    later.join(30)
    assert got and ("team", "g2") in got[0].revoked  # the older read ended after it asked, but began before


def test_a_refresh_whose_read_failed_serves_nobody(ledger):
    state = AuthorityState(ledger)
    connect = ledger.reader.connect
    fail = [True]

    def flaky():
        if fail[0]:
            fail[0] = False
            raise OSError("the database went away")
        return connect()

    ledger.reader.connect = flaky
    with pytest.raises(OSError):
        state.refresh()
    ledger.record("revocation", {"grant": "g3", "authority": "team", "by": "op", "reason": "incident"})
    assert ("team", "g3") in state.refresh().revoked
