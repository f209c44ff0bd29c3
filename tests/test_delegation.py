"""Delegation only narrows: property tests over random grants, facts and chains of delegations."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from blocks import DelegationRefused, Grant, RunFacts, delegate, violations

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
KINDS, MODELS, TYPES = ["training", "inference", "model-call"], ["m1", "m2", "m3"], ["H100", "A100", "A10"]


def names(pool):
    return st.one_of(st.just(["*"]), st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))


expiry = st.one_of(st.none(), st.integers(1, 1000).map(lambda h: NOW + timedelta(hours=h)))

grant_st = st.builds(
    Grant, id=st.just("root"), principal=st.just("team-a/*"), kinds=names(KINDS), models=names(MODELS),
    gpu_types=names(TYPES), max_gpus=st.integers(0, 8), max_cost_per_run=st.floats(0, 100),
    budget_share=st.floats(0, 1), expires_at=expiry, can_delegate=st.just(True), can_approve=st.booleans(),
)

# A delegation attempt: any subset of dimensions, each possibly wider than the parent's.
attempt_st = st.fixed_dictionaries({}, optional={
    "kinds": names(KINDS), "models": names(MODELS), "gpu_types": names(TYPES),
    "max_gpus": st.integers(0, 10), "max_cost_per_run": st.floats(0, 120), "budget_share": st.floats(0, 1),
    "expires_at": expiry, "can_delegate": st.booleans(), "can_approve": st.booleans(),
})

facts_st = st.builds(
    RunFacts, principal=st.just("team-a/x"), kind=st.sampled_from(KINDS), model=st.none() | st.sampled_from(MODELS),
    gpus=st.sampled_from([0, 0.5, 1, 2, 4, 8]), gpu_types=st.lists(st.sampled_from(TYPES), max_size=2, unique=True).map(tuple),
    est_cost=st.floats(0, 120),
)

AT = [NOW, NOW + timedelta(hours=500), NOW + timedelta(hours=2000)]


@settings(max_examples=300, deadline=None)
@given(root=grant_st, attempts=st.lists(attempt_st, min_size=1, max_size=6), probes=st.lists(facts_st, min_size=1, max_size=10))
def test_no_sequence_of_delegations_widens_any_dimension(root, attempts, probes):
    chain = [root]
    for i, attempt in enumerate(attempts):
        try:
            child = delegate(chain[-1], id=f"g{i}", principal=f"team-a/agent-{i}", now=NOW, **attempt)
        except DelegationRefused as exc:
            # Refused: it was wider somewhere, or the parent may not delegate at all.
            assert exc.dimension in {"can_delegate", *attempt} , exc
            continue
        assert violations(chain[-1], child) == []
        chain.append(child)
    leaf = chain[-1]
    for ancestor in chain[:-1]:
        assert violations(ancestor, leaf) == []  # narrowing is transitive along the chain
        for facts in probes:
            for when in AT:
                if leaf.refusal(facts, when) is None:  # whatever the leaf may run, every ancestor may run
                    assert ancestor.refusal(facts, when) is None


@settings(max_examples=200, deadline=None)
@given(root=grant_st, attempt=attempt_st)
def test_a_wider_delegation_is_refused_with_the_dimension_named(root, attempt):
    wider = violations(root, Grant(id="c", principal="team-a/c", **{
        **{d: getattr(root, d) for d in ("kinds", "models", "gpu_types", "max_gpus", "max_cost_per_run",
                                          "budget_share", "expires_at")}, **attempt}))
    assume(wider)
    with pytest.raises(DelegationRefused) as refused:
        delegate(root, id="c", principal="team-a/c", now=NOW, **attempt)
    assert refused.value.dimension in {d for d, _ in wider}
    assert refused.value.dimension in str(refused.value)


def test_a_delegated_grant_may_not_raise_the_priority_cap():
    root = Grant(id="r", principal="team-a/*", max_gpus=4, max_cost_per_run=10.0, max_priority=5, can_delegate=True)
    assert delegate(root, id="c", principal="team-a/x", max_priority=2).max_priority == 2
    with pytest.raises(DelegationRefused, match=r"\(max_priority\).*9 is above the parent's 5"):
        delegate(root, id="c", principal="team-a/x", max_priority=9)


def test_what_a_parent_may_not_delegate():
    root = Grant(id="root", principal="team-a/*", max_gpus=4, max_cost_per_run=10, can_delegate=True)
    with pytest.raises(DelegationRefused, match=r"\(max_gpus\).*8 is above the parent's 4"):
        delegate(root, id="c", principal="team-a/x", max_gpus=8)
    with pytest.raises(DelegationRefused, match=r"\(can_approve\)"):
        delegate(root, id="c", principal="team-a/x", can_approve=True)
    with pytest.raises(DelegationRefused, match=r"\(principal\)"):
        delegate(root, id="c", principal="team-a/*")
    child = delegate(root, id="c", principal="team-a/x", max_gpus=2)
    assert child.parent == "root" and child.max_gpus == 2 and not child.can_delegate
    with pytest.raises(DelegationRefused, match=r"\(can_delegate\).*does not allow delegation"):
        delegate(child, id="grandchild", principal="team-a/y")
    with pytest.raises(DelegationRefused, match=r"\(revoked\)"):
        delegate(root.model_copy(update={"revoked": True}), id="c", principal="team-a/x")
    expiring = root.model_copy(update={"expires_at": NOW + timedelta(days=1)})
    with pytest.raises(DelegationRefused, match=r"\(expires_at\)"):
        delegate(expiring, id="c", principal="team-a/x", now=NOW, expires_at=None)
