"""A map's shared decision, as a unit: how long it holds for the shards of one array and for calls that are not one."""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest

from aisched_prefect.control.admission import decisions as decisions_module
from aisched_prefect.control.admission.decisions import Decisions
from aisched_prefect.control.admission.phases import Case
from aisched_prefect.control.admission.stages import Bound
from aisched_prefect.control.authority.identity import Credential
from aisched_prefect.control.authority.state import Applied, Snapshot
from aisched_prefect.request import AIRequest
from aisched_prefect.wire import CallMeta, MapShard
from blocks import ApprovalPolicyBlock, ApprovalRule
from blocks.budget import CostEstimate

HOUR = 3600.0 * 500_000  # a whole UTC hour


def _applied(kind: str, model: object = None) -> Applied:
    return Applied(kind=kind, name="t", version=1, digest="d" * 64, seq=1, body={}, model=model)


def _case(array: MapShard | None, policy: ApprovalPolicyBlock | None, index: int = 0) -> Case:
    cred = Credential(id="0" * 16, secret_sha256="s" * 64, principal="team/nightly", tenant="team", role="flow",
                      created_by="ops")
    request = AIRequest(kind="inference", gpus=1, gpu_type="A10", est_seconds=60)
    meta = CallMeta(task_name="infer", task_run_id=str(uuid.uuid4()), flow_run_id="f", flow_name="batch",
                    run_key="k", request=request.model_dump(mode="json"), code_digest="c" * 64,
                    array=array if array is None else array.model_copy(update={"index": index}))
    bound = Bound(authority=_applied("authority"), budget=_applied("budget"),
                  policy=_applied("policy", policy) if policy is not None else None, cluster=None)
    case = Case.new(cred, meta, request, "p" * 64, "a" * 64, "f" * 64, None, "r")
    return replace(case, bound=bound, estimate=CostEstimate(amount=1.0))


def _decided_at(monkeypatch: pytest.MonkeyPatch, first: Case, later: Case, kept_at: float, asked_at: float) -> bool:
    """Whether `later`, asked at `asked_at`, reuses the decision `first` took at `kept_at`."""
    d, snap = Decisions(), Snapshot(seq=1)
    monkeypatch.setattr(decisions_module.time, "time", lambda: kept_at)
    d.keep(snap, first)
    monkeypatch.setattr(decisions_module.time, "time", lambda: asked_at)
    return "decided_with" in d.reuse(snap, later).payload


ARRAY = MapShard(id=uuid.uuid4().hex, index=0, size=3)
BY_HOURS = ApprovalPolicyBlock(rules=[ApprovalRule(name="night", action="ask", hours_utc="18-8", min_gpus=8)])
NOT_BY_HOURS = ApprovalPolicyBlock(rules=[ApprovalRule(name="big", action="ask", min_gpus=8)])


@pytest.mark.parametrize("policy", [None, NOT_BY_HOURS], ids=["no-policy", "no-rule-by-hours"])
def test_an_arrays_decision_holds_across_a_whole_hour_when_no_rule_turns_on_it(monkeypatch, policy):
    assert _decided_at(monkeypatch, _case(ARRAY, policy), _case(ARRAY, policy, 2), HOUR - 2, HOUR + 4)


def test_an_arrays_decision_ends_at_the_hour_under_a_rule_by_hours_utc(monkeypatch):
    assert _decided_at(monkeypatch, _case(ARRAY, BY_HOURS), _case(ARRAY, BY_HOURS, 1), HOUR - 6, HOUR - 3)
    assert not _decided_at(monkeypatch, _case(ARRAY, BY_HOURS), _case(ARRAY, BY_HOURS, 2), HOUR - 2, HOUR + 4)


def test_an_arrays_decision_ends_after_its_life_and_a_plain_calls_after_two_seconds(monkeypatch):
    t = HOUR + 10
    assert not _decided_at(monkeypatch, _case(ARRAY, None), _case(ARRAY, None, 2), t,
                           t + decisions_module.ARRAY_SECONDS + 1)
    assert _decided_at(monkeypatch, _case(None, None), _case(None, None), t, t + 1)
    assert not _decided_at(monkeypatch, _case(None, None), _case(None, None), t, t + 2.5)


def test_an_arrays_decision_ends_with_a_new_snapshot(monkeypatch):
    d = Decisions()
    monkeypatch.setattr(decisions_module.time, "time", lambda: HOUR + 10)
    d.keep(Snapshot(seq=1), _case(ARRAY, None))
    assert "decided_with" not in d.reuse(Snapshot(seq=2), _case(ARRAY, None, 1)).payload

