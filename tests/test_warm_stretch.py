"""Back-to-back runs of a map in one warm body share one idle period (control.dispatch.warm `_carry`).

Before, every shard that took a warm body and left it warm settled the body's idle period (a ledger write, a
`warm-idle` record, the row moved) and held a new one (a write, a `warm-hold` record, the row written): half of a
map's four records a shard, and a fifth of the plane's CPU in a `--gil` profile. Now a run that took the body
carries its period on under the same hold while that hold covers it; the one `warm-idle` record that settles it
lists each wait and the run that ended it. Units over a real ledger (SQLite, or Postgres where asked); no cluster.
"""

from __future__ import annotations

import uuid

import pytest

from aisched_prefect.control.admission.record import Admission
from aisched_prefect.control.dispatch import warm
from aisched_prefect.control.dispatch.warm import WarmBooks
from aisched_prefect.ledger import Hold, Ledger
from aisched_prefect.request import AIRequest
from blocks import BudgetLine, RunFacts

PRICE = 0.01  # money a second of idle share, in these books
WORKER = "tls://127.0.0.1:4000"


def _admission(n: int, flow_run_id: str, period: str = "2026-12") -> Admission:
    hold = Hold(id=f"run-hold-{n}", budget="team-a", period=period, reserved=1.0, remaining_before=100.0,
                remaining_after=99.0)
    return Admission(id=str(n), credential="c", principal="team-a/nightly", tenant="team-a", flow_run_id=flow_run_id,
                     task_run_id=str(uuid.uuid4()), task_name="score", flow_name="batch", run_key=f"fr/score-{n}",
                     request=AIRequest.build(kind="batch-inference", gpus=0.25, est_seconds=30), workers=[],
                     holds=[hold], reserved=1.0, priced_type="H100", chain=["team-a-root"], expires_at=None,
                     facts=RunFacts(principal="team-a/nightly", kind="batch-inference"), payload_digest="p" * 64,
                     code_digest="c" * 64)


def _body(runs: int, idle_before: float = 0.0, *, kept: bool = True, keep: float = 60.0) -> dict:
    return {"id": "body-1", "start": "cold" if runs == 1 else "warm", "runs": runs, "idle_before": idle_before,
            "kept": kept, "keep": keep}


@pytest.fixture
def books(ledger_url):
    ledger = Ledger(ledger_url)
    ended: list = []
    b = WarmBooks(ledger, bound=lambda adm: None, end_bodies=lambda ids, why: ended.append((ids, why)))
    b._lines = lambda adm, gpu_type, seconds: (  # type: ignore[method-assign]
        [BudgetLine(budget="team-a", period=adm.holds[0].period, limit=100.0, amount=seconds * PRICE)],
        {"team-a": seconds * PRICE})
    b.ended_asked = ended
    yield b
    ledger.close()


def _kinds(books: WarmBooks, flow_run_id: str) -> list[str]:
    return [r.kind for r in books.ledger.records(flow_run_id) if r.kind.startswith("warm")]


def test_back_to_back_runs_carry_one_idle_period_settled_once_with_each_wait(books):
    fr = str(uuid.uuid4())
    books.started(_admission(1, fr), _body(1), "H100", WORKER)
    books.started(_admission(2, fr), _body(2, idle_before=0.5), "H100", WORKER)
    books.started(_admission(3, fr), _body(3, idle_before=0.25), "H100", WORKER)
    assert _kinds(books, fr) == ["warm-hold"]  # one hold for the three waits, nothing settled yet
    [p] = books.periods()
    assert (p.runs, p.held_runs, p.before, p.admission.id) == (3, 1, 0.75, "3")  # its last run's authority
    row = books.rows.row("body-1")  # the row follows it: a plane started again knows the waits and the last run
    assert (row["state"], row["runs"], row["idle_before"], row["admission"]["id"]) == ("idle", 3, 0.75, "3")
    assert row["waits"] == [["2", 0.5], ["3", 0.25]]
    assert books.load() == 1 and [(q.runs, q.before) for q in books.periods()] == [(3, 0.75)]

    books.ended("body-1", 3, 2.0, "keep-warm time passed", worker=WORKER)
    assert _kinds(books, fr) == ["warm-hold", "warm-idle"]
    idle = books.ledger.records(fr)[-1].payload
    assert idle["seconds"] == pytest.approx(2.75) and idle["periods"] == 3
    assert idle["waits"] == [{"admission": "2", "seconds": 0.5}, {"admission": "3", "seconds": 0.25}]
    assert idle["charges"] == {"team-a": pytest.approx(2.75 * PRICE)}
    assert books.rows.row("body-1")["state"] == "ended" and books.periods() == []
    assert books.ledger.verify().ok


def test_a_run_that_does_not_fit_the_open_hold_settles_it_and_holds_anew(books, monkeypatch):
    fr, other = str(uuid.uuid4()), str(uuid.uuid4())
    books.started(_admission(1, fr), _body(1), "H100", WORKER)
    books.started(_admission(2, other), _body(2, idle_before=1.0), "H100", WORKER)  # another flow run's
    assert _kinds(books, fr) == ["warm-hold", "warm-idle"] and _kinds(books, other) == ["warm-hold"]
    books.started(_admission(3, other, period="2027-01"), _body(3, idle_before=1.0), "H100", WORKER)  # new month
    books.started(_admission(4, other, period="2027-01"), _body(4, idle_before=1.0), "A100", WORKER)  # other type
    books.started(_admission(5, other, period="2027-01"), _body(5, idle_before=40.0), "A100", WORKER)  # past a share
    monkeypatch.setattr(warm, "STRETCH_SECONDS", 0.0)  # the hold taken longer ago than a stretch may last
    books.started(_admission(6, other, period="2027-01"), _body(6, idle_before=0.1), "A100", WORKER)
    assert _kinds(books, other) == ["warm-hold"] + ["warm-idle", "warm-hold"] * 4
    settled = [r.payload for r in books.ledger.records(other) if r.kind == "warm-idle"]
    assert [p["seconds"] for p in settled] == [1.0, 1.0, 40.0, 0.1] and all("periods" not in p for p in settled)
    books.started(_admission(7, other, period="2027-01"), _body(7, idle_before=0.2, kept=False), "A100", WORKER)
    assert _kinds(books, other)[-1] == "warm-idle" and books.periods() == []  # ended with its run: settled


def test_a_body_asked_to_end_is_not_carried_on(books):
    fr = str(uuid.uuid4())
    books.started(_admission(1, fr), _body(1), "H100", WORKER)
    assert books.end_idle(["body-1"], "nothing of its key waits") == ["body-1"]
    books.started(_admission(2, fr), _body(2, idle_before=0.3), "H100", WORKER)  # it was taken meanwhile
    assert _kinds(books, fr) == ["warm-hold", "warm-idle", "warm-hold"]


def test_a_plane_started_again_takes_a_carried_period_from_its_row_and_the_workers_word_ends_it(books, ledger_url):
    fr = str(uuid.uuid4())
    books.started(_admission(1, fr), _body(1, keep=60.0), "H100", WORKER)
    books.started(_admission(2, fr), _body(2, idle_before=0.5, keep=60.0), "H100", WORKER)
    again = WarmBooks(Ledger(ledger_url), bound=lambda adm: None, end_bodies=lambda ids, why: None)
    again._lines = books._lines  # type: ignore[method-assign]
    assert again.load() == 1
    [p] = again.periods()
    assert (p.runs, p.held_runs, p.before, p.gaps, p.admission.id) == (2, 1, 0.5, (("2", 0.5),), "2")
    again.started(_admission(3, fr), _body(3, idle_before=0.25, keep=60.0), "H100", WORKER)  # not carried on here:
    assert _kinds(again, fr) == ["warm-hold", "warm-idle", "warm-hold"]  # its hold's age is not known
    first = [r.payload for r in again.ledger.records(fr) if r.kind == "warm-idle"][0]
    assert first["seconds"] == pytest.approx(0.75) and first["periods"] == 2
    again.ended("body-1", 3, 4.0, "keep-warm time passed", worker=WORKER)  # the worker's event names its runs
    assert [r.payload["seconds"] for r in again.ledger.records(fr) if r.kind == "warm-idle"][1:] == [4.0]
    assert again.rows.row("body-1")["state"] == "ended" and again.periods() == []
    again.ledger.close()


def test_a_carried_period_is_charged_its_waits_once_when_the_plane_stops_or_its_worker_dies(books):
    fr = str(uuid.uuid4())
    books.started(_admission(1, fr), _body(1), "H100", WORKER)
    books.started(_admission(2, fr), _body(2, idle_before=10.0), "H100", WORKER)
    [p] = books.periods()
    books.worker_died(WORKER, at=p.since + 5.0)
    [idle] = [r.payload for r in books.ledger.records(fr) if r.kind == "warm-idle"]
    assert idle["seconds"] == pytest.approx(15.0) and idle["periods"] == 2  # 10 s carried + 5 s to the death


def test_a_stale_word_about_a_carried_period_settles_nothing(books):
    """A reconcile pass copies the periods, asks the workers, then acts: a run carried the period on meanwhile, so
    its word (the body busy with that run) is about the period as it was, which is no longer booked."""
    fr = str(uuid.uuid4())
    books.started(_admission(1, fr), _body(1), "H100", WORKER)
    [stale] = books.periods()
    books.started(_admission(2, fr), _body(2, idle_before=0.5), "H100", WORKER)
    books.ended(stale.body, stale.runs, 0.5, "a run of its key", taken=True)  # the stale pass's word
    assert _kinds(books, fr) == ["warm-hold"] and [q.runs for q in books.periods()] == [2]
    assert stale.runs == 1 and stale.before == 0.0  # the copy it held did not change under it


def test_a_period_whose_row_moved_first_is_settled_and_held_anew_not_carried(books):
    fr = str(uuid.uuid4())
    books.started(_admission(1, fr), _body(1), "H100", WORKER)
    assert books.rows.left_idle("body-1", 1, taken=False, why="another replica ended it")  # its row moved first
    books.started(_admission(2, fr), _body(2, idle_before=0.5), "H100", WORKER)
    assert _kinds(books, fr) == ["warm-hold", "warm-idle", "warm-hold"]
    assert [(q.runs, q.before) for q in books.periods()] == [(2, 0.0)]


def test_a_carried_periods_body_ends_before_its_waits_outrun_its_hold(books):
    """The worker ends a body after its keep-warm time idle since its last run; a carried period's hold covers that
    time from its first wait, so the plane ends the body as the waits reach the hold (a margin early)."""
    fr = str(uuid.uuid4())
    books.started(_admission(1, fr), _body(1, keep=8.0), "H100", WORKER)
    assert books.end_spent() == []  # nothing carried: the worker's own keep-warm time is the hold's
    books.started(_admission(2, fr), _body(2, idle_before=3.0, keep=8.0), "H100", WORKER)
    [p] = books.periods()
    assert books.end_spent(now=p.since + 2.9) == []  # 5.9 s of 8: more than the 2 s margin left
    assert books.end_spent(now=p.since + 3.1) == ["body-1"]  # 6.1 s: ended now
    assert books.ended_asked == [(["body-1"], "its idle hold is used up")]
    assert books.end_spent(now=p.since + 4.0) == []  # asked once
    books.ended("body-1", 2, p.idle_at(p.since + 3.2), "its idle hold is used up", worker=WORKER)
    [idle] = [r.payload for r in books.ledger.records(fr) if r.kind == "warm-idle"]
    assert idle["seconds"] == pytest.approx(6.2) and idle["periods"] == 2


def test_a_load_or_an_end_during_a_carry_waits_for_it_or_leaves_it_be(books, ledger_url):
    """The carry moves its row outside the books' lock: the watcher's `load` in that moment neither drops the period
    nor books the moved row a second time, and the worker's end of the carried period waits for the carry, then
    settles all of it once."""
    import threading

    fr = str(uuid.uuid4())
    books.started(_admission(1, fr), _body(1), "H100", WORKER)
    real, ends = books.rows.carry, []

    def carry_then_load_and_end(*args, **kwargs):
        moved = real(*args, **kwargs)
        books.load()  # reads the moved row while the books still hold the period as it was
        ends.append(threading.Thread(target=books.ended, args=("body-1", 2, 1.0, "keep-warm time passed", WORKER)))
        ends[-1].start()
        return moved

    books.rows.carry = carry_then_load_and_end
    books.started(_admission(2, fr), _body(2, idle_before=0.5), "H100", WORKER)
    ends[0].join(10)
    assert _kinds(books, fr) == ["warm-hold", "warm-idle"] and books.periods() == []
    [idle] = [r.payload for r in books.ledger.records(fr) if r.kind == "warm-idle"]
    assert idle["seconds"] == pytest.approx(1.5) and idle["periods"] == 2
    assert books.ledger.history(task_run_id="warm-body-1-1")[0]["status"] == "posted"


def test_another_replicas_stale_word_does_not_settle_a_period_carried_on(books, ledger_url):
    fr = str(uuid.uuid4())
    books.started(_admission(1, fr), _body(1), "H100", WORKER)
    other = WarmBooks(Ledger(ledger_url), bound=lambda adm: None, end_bodies=lambda ids, why: None)
    other._lines = books._lines  # type: ignore[method-assign]
    assert other.load() == 1
    [stale] = other.periods()
    books.started(_admission(2, fr), _body(2, idle_before=0.5), "H100", WORKER)  # carried on by this replica
    other.ended(stale.body, stale.runs, 3.0, "its worker no longer has it")  # the other's word, as it was
    assert _kinds(books, fr) == ["warm-hold"]  # nothing settled by it
    books.ended("body-1", 2, 1.0, "keep-warm time passed", worker=WORKER)
    [idle] = [r.payload for r in books.ledger.records(fr) if r.kind == "warm-idle"]
    assert idle["seconds"] == pytest.approx(1.5)
    other.ledger.close()


def test_a_period_whose_row_a_later_outcome_took_stays_booked_until_its_own_end(books):
    """Outcomes are settled on several threads: run 3's can come before run 2's, and its period's row (one a body)
    is written over the open period 1's. The watcher's `load` keeps period 1 (a carried one lives up to 15 s): it
    ends when run 2's outcome says how long it waited, and no hold is left to expire charged in full."""
    fr = str(uuid.uuid4())
    books.started(_admission(1, fr), _body(1), "H100", WORKER)
    books.started(_admission(3, fr), _body(3, idle_before=0.2), "H100", WORKER)  # before run 2's outcome
    assert books.rows.row("body-1")["runs"] == 3
    books.load()
    assert sorted(p.runs for p in books.periods()) == [1, 3]
    books.started(_admission(2, fr), _body(2, idle_before=0.1), "H100", WORKER)
    settled = {r.task_run_id: r.payload["seconds"] for r in books.ledger.records(fr) if r.kind == "warm-idle"}
    assert settled == {"warm-body-1-1": 0.1, "warm-body-1-2": 0.2}
    assert [p.runs for p in books.periods()] == [3]
    pending = [h for h in books.ledger.history(limit=50) if h["status"] == "pending"]
    assert [h["task_run_id"] for h in pending] == ["warm-body-1-3"], pending


def test_ends_heard_before_any_booking_keep_the_newest_and_never_grow_past_a_bound(books, monkeypatch):
    """An end whose period is never booked (its outcome's booking failed) was kept for the plane's life, and past
    100,000 such ends the next, real one was dropped: the oldest now go first."""
    import aisched_prefect.control.dispatch.warm as warm

    monkeypatch.setattr(warm, "EARLY_KEPT", 5)
    for i in range(8):
        books.ended(f"never-booked-{i}", 1, 1.0, "its worker said so")
    assert list(books._early) == [(f"never-booked-{i}", 1) for i in range(3, 8)]
