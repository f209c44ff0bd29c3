"""A map's later shards hold their budget as the queue starts them, as units: which shards wait holding nothing, and
how dispatch takes the hold (refused by name, through a ledger restart, never twice)."""

from __future__ import annotations

import uuid
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from aisched_prefect.control.admission.pipeline import holds_at_start
from aisched_prefect.control.dispatch.queueing import Queueing
from aisched_prefect.control.dispatch.running import Running
from aisched_prefect.errors import AdmissionDenied, LedgerUnavailable
from aisched_prefect.ledger import Hold
from aisched_prefect.request import AIRequest
from aisched_prefect.wire import MapShard
from tests.test_decisions import _case

ARRAY = MapShard(id=uuid.uuid4().hex, index=0, size=3, name="infer-1")
GPU_RUNS = lambda request: request.gpus > 0  # noqa: E731 - the queue on: GPU runs are started by it


def test_only_a_maps_later_shards_of_runs_the_queue_starts_wait_holding_nothing():
    first, later = _case(ARRAY, None), _case(ARRAY, None, 1)
    later = replace(later, payload={**later.payload, "decided_with": first.ids["task_run_id"]})
    assert holds_at_start(later, GPU_RUNS)
    assert not holds_at_start(first, GPU_RUNS)  # the first holds as it is admitted: a map no budget covers ends at once
    assert not holds_at_start(later, None)  # a plane that cannot say (no queue): held at admission
    assert not holds_at_start(later, lambda request: False)
    single = _case(None, None)
    assert not holds_at_start(replace(single, payload={**single.payload, "decided_with": "x"}), GPU_RUNS)


HOLD = Hold(id="h1", budget="b", period="2026-12", reserved=0.1, remaining_before=1.0, remaining_after=0.9)


def _admission(**update: Any) -> Any:
    from aisched_prefect.control.admission.record import Admission
    from blocks import RunFacts

    request = AIRequest(kind="inference", gpus=1, gpu_type="A10", est_seconds=60)
    facts = RunFacts(principal="team/nightly", tenant="team", kind="inference", gpus=1, est_seconds=60)
    base = Admission(id="7", credential="c", principal="team/nightly", tenant="team", flow_run_id="f",
                     task_run_id="t", task_name="infer", flow_name="batch", run_key="k", request=request,
                     workers=[], holds=[], reserved=0.1, priced_type="A10", chain=["root"], expires_at=None,
                     facts=facts, payload_digest="p" * 64, code_digest="c" * 64, array=ARRAY, hold_at_start=True)
    return base.model_copy(update=update)


class _Plane(Queueing):
    """The parts of the dispatcher `_hold_at_start` reads: its settlements, its patience, its ledger's records."""

    def __init__(self, records: list[Any] | None = None) -> None:
        self.settled: list[dict[str, Any]] = []
        self.ledger = SimpleNamespace(records_about=lambda run: records or [])

    def settle(self, state: Any, charges: Any, payload: dict[str, Any]) -> None:
        self.settled.append({"charges": charges, **payload})

    def settle_patience(self) -> float:
        return 5.0


def _state() -> Running:
    return Running(admission=_admission(), key="aisched-x", holds=[], covered_seconds=60.0, submitted=0.0)


class _Admitter:
    def __init__(self, *answers: Any) -> None:
        self.answers, self.asked = list(answers), 0

    def readmit(self, admission: Any, reason: str) -> Any:
        raise AssertionError("not a preemption")

    def hold_at_start(self, admission: Any) -> Any:
        self.asked += 1
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


def test_a_shard_the_budget_no_longer_covers_is_refused_as_it_starts_and_settled_once_with_nothing_held():
    plane, state = _Plane(), _state()
    refusal = AdmissionDenied("budget", "shard 'infer-1' (#1 of 3) of the map: budget 'b' has 0.05 left", "raise it")
    reply = plane._hold_at_start(state, _Admitter(refusal))
    assert reply is not None and reply.status == "denied" and reply.stage == "budget"
    assert "shard 'infer-1' (#1 of 3)" in reply.reason and reply.fix == "raise it"
    assert plane.settled == [{"charges": None, "outcome": "refused-at-start", "stage": "budget",
                              "error": refusal.reason}]
    assert state.holds == [] and state.admission.hold_at_start


def test_a_shard_that_holds_as_it_starts_is_renewed_and_settled_by_that_hold():
    plane, state = _Plane(), _state()
    held = _admission(holds=[HOLD], hold_at_start=False)
    assert plane._hold_at_start(state, _Admitter(held)) is None
    assert state.holds == [HOLD] and state.admission == held and plane.settled == []


def test_a_hold_whose_commit_answer_was_lost_is_found_not_taken_twice(monkeypatch):
    import aisched_prefect.control.dispatch.outlast as outlast

    monkeypatch.setattr(outlast.time, "sleep", lambda s: None)
    record = SimpleNamespace(kind="shard-hold", payload={"admission": "7", "holds": [HOLD.model_dump()]})
    plane, state = _Plane([record]), _state()
    admitter = _Admitter(LedgerUnavailable("the commit's answer was lost"), AssertionError("held twice"))
    assert plane._hold_at_start(state, admitter) is None
    assert admitter.asked == 1 and state.holds == [HOLD] and not state.admission.hold_at_start


def test_a_ledger_restart_as_a_shard_starts_is_waited_out(monkeypatch):
    import aisched_prefect.control.dispatch.outlast as outlast

    monkeypatch.setattr(outlast.time, "sleep", lambda s: None)
    plane, state = _Plane(), _state()
    held = _admission(holds=[HOLD], hold_at_start=False)
    admitter = _Admitter(LedgerUnavailable("restarting"), LedgerUnavailable("restarting"), held)
    assert plane._hold_at_start(state, admitter) is None
    assert admitter.asked == 3 and state.holds == [HOLD]


def test_a_ledger_down_past_the_patience_fails_the_start_with_its_cause(monkeypatch):
    import aisched_prefect.control.dispatch.outlast as outlast

    clock = iter(range(0, 1000, 3))
    monkeypatch.setattr(outlast.time, "sleep", lambda s: None)
    monkeypatch.setattr(outlast.time, "monotonic", lambda: float(next(clock)))
    plane, state = _Plane(), _state()
    with pytest.raises(LedgerUnavailable):
        plane._hold_at_start(state, _Admitter(*[LedgerUnavailable("down")] * 10))
    assert state.holds == []


def test_an_idle_body_the_queue_gave_a_refused_shard_is_ended(monkeypatch):
    """The queue handed the shard an idle warm body and gives its place back as the shard leaves: the body ends,
    so it does not keep devices the queue counts free."""
    from aisched_prefect.control.dispatch import queueing
    from aisched_prefect.control.dispatch.running import Placement

    ended: list[tuple[list[str], str]] = []
    monkeypatch.setattr(queueing, "end_warm", lambda client, bodies, why: ended.append((bodies, why)) or bodies)
    plane, state = _Plane(), _state()
    plane.client = object()
    state.placement = Placement(workers=["w0"], body="body-1")
    refusal = AdmissionDenied("budget", "shard 'infer-1' (#1 of 3) of the map: no room", "raise it")
    assert plane._hold_at_start(state, _Admitter(refusal)).status == "denied"
    assert ended == [(["body-1"], "the run placed on it was refused as it started (budget)")]


def test_a_calls_new_holds_are_filed_with_it_in_their_transaction():
    """A preempted run admitted again, or a map's shard held as it starts, files its admission with its call in
    the transaction of its hold (the connection the ledger hands `on_admitted`): a replica that takes the call
    over settles those holds, not ones already settled, and does not hold again."""
    from aisched_prefect.control.runs import CallAdmitter

    filed: list[tuple[str, dict, Any]] = []
    again = _admission(id="9", holds=[HOLD], hold_at_start=False)

    class Pipeline:
        def readmit(self, admission, reason, on_admitted):
            on_admitted("conn-of-the-hold", again)
            return again

        def hold_at_start(self, admission, on_held):
            on_held("conn-of-the-hold", again)
            return again

    calls = SimpleNamespace(admitted=lambda key, adm, conn: filed.append((key, adm, conn)))
    admitter = CallAdmitter(Pipeline(), calls, "call-1")  # type: ignore[arg-type]
    assert admitter.readmit(_admission(), "preempted") is again
    assert admitter.hold_at_start(_admission()) is again
    assert filed == [("call-1", again.model_dump(mode="json"), "conn-of-the-hold")] * 2
