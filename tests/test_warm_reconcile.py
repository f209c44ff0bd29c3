"""The warm books against the workers' reports (control.warm_reconcile), with books that record what is settled:
each idle period is settled by what the worker measured, up to when its worker left, or (taken by a run whose
outcome was lost) by how long it waited for that run; a body nobody booked is ended once it idled past the grace."""

from __future__ import annotations

import time
from dataclasses import dataclass

from aisched_prefect.control.dispatch.warm_reconcile import UNKNOWN_GRACE_SECONDS, reconcile


@dataclass
class Period:
    body: str
    runs: int
    worker: str
    since: float
    keep: float = 600.0

    def idle_at(self, at: float | None = None) -> float:
        return min(max((time.time() if at is None else at) - self.since, 0.0), self.keep)


class Books:
    def __init__(self, periods: list[Period]) -> None:
        self._periods, self.settled = periods, []

    def load(self) -> int:
        return len(self._periods)

    def periods(self) -> list[Period]:
        return list(self._periods)

    def ended(self, body: str, runs: int, idle: float, why: str, worker: str | None = None, taken: bool = False):
        self.settled.append((body, runs, round(idle, 1), why, taken))
        self._periods = [p for p in self._periods if (p.body, p.runs) != (body, runs)]


def test_each_idle_period_is_settled_by_its_real_end_and_unknown_bodies_end():
    now = time.time()
    books = Books([Period("waiting", 1, "w1", now - 50), Period("ended", 2, "w1", now - 100),
                   Period("taken", 3, "w1", now - 100), Period("gone", 1, "w2", now - 100),
                   Period("forgotten", 1, "w1", now - 20), Period("silent", 1, "w3", now - 100)])
    reports = {"w1": {"idle": [{"id": "waiting", "runs": 1, "idle": 50.0},
                               {"id": "stray", "runs": 4, "idle": UNKNOWN_GRACE_SECONDS + 1},
                               {"id": "young", "runs": 1, "idle": 1.0}],
                      "busy": [{"id": "taken", "runs": 4, "idle_before": 7.0}],
                      "ended": [{"id": "ended", "runs": 2, "idle": 12.5, "reason": "keep-warm time passed"}]},
               "w3": None}  # w3 did not answer this time; w2 left 30 s after its body went idle
    ended: list = []
    done = reconcile(books, lambda: (reports, {"w2": now - 70}), lambda ids, why: ended.append((ids, why)))
    assert sorted(books.settled) == sorted([
        ("ended", 2, 12.5, "keep-warm time passed", False), ("taken", 3, 7.0, "a run of its key", True),
        ("gone", 1, 30.0, "its worker w2 left", False), ("forgotten", 1, 20.0, "its worker no longer has it", False)])
    assert [p.body for p in books.periods()] == ["waiting", "silent"]
    assert ended == [(["stray"], "no control plane booked it (its run's outcome was lost)")]
    assert done == {"settled": 3, "taken": 1, "unknown_ended": 1}


def test_an_earlier_idle_periods_row_written_last_does_not_hide_the_later_one(ledger_url):
    """Two runs of one body settle on two threads: the row of period 3 may be written after period 4's. A body has
    one row, so the later period must stay the row's (else a restarted plane's books, and `load`, lose it and its
    hold waits out the keep-warm time)."""
    import uuid

    from aisched_prefect.control.admission.record import Admission
    from aisched_prefect.control.dispatch.warm_rows import BodyRows
    from aisched_prefect.ledger import Ledger
    from blocks import RunFacts
    from aisched_prefect.request import AIRequest

    adm = Admission(id="7", credential="c", principal="team-a/nightly", tenant="team-a", flow_run_id=str(uuid.uuid4()),
                    task_run_id=str(uuid.uuid4()), task_name="score", flow_name="f", run_key="fr/score",
                    request=AIRequest.build(kind="batch-inference", gpus=0.25, est_seconds=30), workers=[], holds=[],
                    reserved=0.0, priced_type="H100", chain=["team-a-root"], expires_at=None,
                    facts=RunFacts(principal="team-a/nightly", kind="batch-inference"), payload_digest="p" * 64,
                    code_digest="c" * 64)
    rows = BodyRows(Ledger(ledger_url))
    for runs in (4, 3):  # the later period's row first, as the race wrote them
        rows.idle("body-1", runs, adm, [], 30.0, "H100", "tls://w", "k", since=time.time(), started_at=time.time())
    assert [(r.body, r.runs) for r in rows.load_idle()] == [("body-1", 4)]
    assert not rows.left_idle("body-1", 3, taken=True, why="a run of its key")  # period 3's end leaves 4 idle
    assert [(r.body, r.runs) for r in rows.load_idle()] == [("body-1", 4)]
    rows.idle("body-1", 5, adm, [], 30.0, "H100", "tls://w", "k", since=time.time(), started_at=time.time())
    assert [(r.body, r.runs) for r in rows.load_idle()] == [("body-1", 5)]


def test_a_period_settled_or_carried_on_while_the_workers_were_asked_is_not_judged_by_their_older_answers():
    """A busy map's runs take, park and carry bodies while the workers answer: a period that left the books meanwhile
    was taken for an end nobody heard (a warning of 2 to 11 'settled' a pass, and an end kept for a period never
    booked), though its run had settled it."""
    now = time.time()
    carried, waiting = Period("carried", 1, "w1", now - 5), Period("waiting", 1, "w1", now - 5)
    books = Books([carried, waiting])

    def fetch():  # the run that took `carried` parks it again (runs 2) while the worker's answer travels
        books._periods = [Period("carried", 2, "w1", now), waiting]
        return {"w1": {"idle": [{"id": "waiting", "runs": 1, "idle": 5.0}]}}, {}

    done = reconcile(books, fetch, lambda ids, why: None)
    assert books.settled == [] and done == {"settled": 0, "taken": 0, "unknown_ended": 0}
