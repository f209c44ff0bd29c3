"""BudgetBlock limits: which accounts a run must fit, and clear errors for limits that cannot work."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from pydantic import ValidationError

from blocks import BudgetBlock, BudgetLimit, RunFacts, Usage

NOW = datetime(2026, 11, 29, 12, tzinfo=timezone.utc)
PRICES = {"gpu_hour_prices": {"H100": 4.0, "A10": 1.0}, "token_prices_per_1k": {"*": 0.01}}


def facts(**kw) -> RunFacts:
    base = dict(principal="team-a/nightly", tenant="team-a", flow="nightly-train", kind="training",
                model="llama", gpus=2, gpu_types=("H100",), est_seconds=3600)
    return RunFacts(**{**base, **kw})


def block(*limits: BudgetLimit, limit: float | None = 100.0) -> BudgetBlock:
    return BudgetBlock(limit=limit, limits=list(limits), **PRICES)


def test_every_covering_limit_and_its_parents_are_held_in_its_own_unit():
    b = block(
        BudgetLimit(name="team-a", scope="tenant", match="team-a", amount=50),
        BudgetLimit(name="nightly", scope="flow", match="nightly-*", amount=20, parent="team-a"),
        BudgetLimit(name="h100-hours", unit="gpu-hours", scope="gpu-type", match="H100", amount=10),
        BudgetLimit(name="llama-tokens", unit="tokens", scope="model", match="llama", amount=1e6, period="daily"),
        BudgetLimit(name="team-b", scope="tenant", match="team-b", amount=50),
    )
    lines = b.lines("org", facts(), Usage(money=8.0, gpu_hours=2.0, tokens=500), NOW)
    got = {line.budget: (line.unit, line.amount, line.limit, line.period) for line in lines}
    assert got == {
        "org": ("money", 8.0, 100.0, "2026-11"),
        "org/team-a": ("money", 8.0, 50.0, "2026-11"),
        "org/nightly": ("money", 8.0, 20.0, "2026-11"),
        "org/h100-hours": ("gpu-hours", 2.0, 10.0, "2026-11"),
        "org/llama-tokens": ("tokens", 500, 1e6, "2026-11-29"),
    }


def test_a_child_pulls_in_its_parent_even_when_the_parent_scope_would_not_match():
    b = block(BudgetLimit(name="research", scope="tenant", match="research", amount=50),
              BudgetLimit(name="shared-eval", scope="flow", match="eval", amount=10, parent="research"), limit=None)
    lines = b.lines("org", facts(flow="eval"), Usage(money=1.0), NOW)
    assert [line.budget for line in lines] == ["org/research", "org/shared-eval"]


def test_a_run_that_could_land_on_several_types_holds_every_type_limit():
    b = block(BudgetLimit(name="h100", unit="gpu-hours", scope="gpu-type", match="H100", amount=10),
              BudgetLimit(name="a10", unit="gpu-hours", scope="gpu-type", match="A10", amount=10), limit=None)
    lines = b.lines("org", facts(gpu_types=("A10", "H100")), Usage(gpu_hours=1.0), NOW)
    assert sorted(line.budget for line in lines) == ["org/a10", "org/h100"]


def test_rolling_windows_have_their_own_account_and_length():
    b = block(BudgetLimit(name="week", amount=10, period="weekly", window="rolling"), limit=None)
    (line,) = b.lines("org", facts(), Usage(money=1.0), NOW)
    assert line.period == "rolling-7d" and line.rolling_seconds == 7 * 86400


@pytest.mark.parametrize("limits, field, fix", [
    ([BudgetLimit(name="a", amount=10), BudgetLimit(name="a", amount=5)], "a", "unique name"),
    ([BudgetLimit(name="a", amount=10, parent="nope")], "parent", "no limit is named 'nope'"),
    ([BudgetLimit(name="a", amount=10), BudgetLimit(name="b", amount=20, parent="a")], "amount=20", "lower it or raise the parent"),
    ([BudgetLimit(name="a", amount=10), BudgetLimit(name="b", unit="tokens", amount=5, parent="a")], "'b'", "same unit"),
    ([BudgetLimit(name="a", amount=10, parent="b"), BudgetLimit(name="b", amount=10, parent="a")], "a", "cycle"),
])
def test_limits_that_cannot_work_are_refused_naming_the_field(limits, field, fix):
    with pytest.raises(ValidationError) as info:
        BudgetBlock(limit=100, limits=limits)
    assert field in str(info.value) and fix in str(info.value)


@pytest.mark.parametrize("kw, fix", [
    ({"name": "Team A", "amount": 1}, "lowercase"),
    ({"name": "x", "amount": 1, "window": "rolling", "period": "total"}, "rolling window needs period"),
    ({"name": "x", "amount": 1, "match": "team-a"}, "needs a scope"),
    ({"name": "x", "amount": -1}, "greater than or equal to 0"),
    ({"name": "x", "amount": 1, "unit": "dollars"}, "'money', 'gpu-hours' or 'tokens'"),
])
def test_a_bad_limit_names_what_to_change(kw, fix):
    with pytest.raises(ValidationError, match=fix):
        BudgetLimit(**kw)


def test_a_block_with_limits_saves_and_loads(prefect_api):
    b = block(BudgetLimit(name="nightly", scope="flow", match="nightly-*", amount=20))
    b.save("t-budget-limits", overwrite=True)
    assert BudgetBlock.load("t-budget-limits").limits == b.limits
