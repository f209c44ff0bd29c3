"""Bad values are refused where they are declared (blocks, @ai_task requests), naming the field."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from aisched_prefect import InvalidAIRequest, ai_task
from blocks import BudgetBlock, BudgetLine, UnpriceableRequest
from dask_gpu import GPURequest

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize("kw, field", [
    ({"gpu_hour_prices": {"H100": NAN}}, "gpu_hour_prices.H100"),
    ({"gpu_hour_prices": {"H100": -4.0}}, "gpu_hour_prices.H100"),
    ({"gpu_hour_prices": {"H100": INF}}, "gpu_hour_prices.H100"),
    ({"token_prices_per_1k": {"*": NAN}}, "token_prices_per_1k.*"),
    ({"token_prices_per_1k": {"gpt": -0.01}}, "token_prices_per_1k.gpt"),
    ({"limit": INF}, "limit"),
    ({"limit": NAN}, "limit"),
    ({"limit": 1e300}, "limit"),
    ({"limits": [{"name": "x", "amount": INF}]}, "limits.0.amount"),
    ({"limits": [{"name": "x", "amount": NAN}]}, "limits.0.amount"),
])
def test_a_budget_block_refuses_prices_and_limits_no_ledger_can_hold(kw, field):
    with pytest.raises(ValidationError) as info:
        BudgetBlock(**kw)
    assert field in str(info.value)


@pytest.mark.parametrize("kw, field", [
    ({"limit": INF}, "limit"), ({"limit": -1}, "limit"), ({"amount": NAN}, "amount"), ({"amount": -1}, "amount"),
    ({"rolling_seconds": INF}, "rolling_seconds"), ({"config_version": -1}, "config_version"),
])
def test_a_budget_line_refuses_bad_amounts(kw, field):
    with pytest.raises(ValidationError) as info:
        BudgetLine(**{"budget": "org", "period": "2026-11", "limit": 1.0, **kw})
    assert field in str(info.value)


def test_a_run_that_costs_more_than_a_budget_can_hold_is_unpriceable_not_an_overflow():
    block = BudgetBlock(limit=10, gpu_hour_prices={"H100": 1e12})
    with pytest.raises(UnpriceableRequest, match="more than a budget can hold"):
        block.estimate(64, 86_400.0, ["H100"])


@pytest.mark.parametrize("kwargs, field", [
    ({"gpus": 1, "est_seconds": INF}, "est_seconds"),
    ({"gpus": 1, "est_seconds": NAN}, "est_seconds"),
    ({"gpus": 1, "est_seconds": 600, "gpu_memory_gb": INF}, "gpu_memory_gb"),
    ({"kind": "model-call", "model": "gpt", "est_tokens": 2**70}, "est_tokens"),
    ({"gpus": 1, "est_seconds": 600, "gpu_type": ""}, "gpu_type"),
    ({"gpus": 1, "est_seconds": 600, "gpu_type": ["H100", " "]}, "gpu_type"),
    ({"gpus": 1e-9, "est_seconds": 600}, "gpus"),
    ({"gpus": NAN, "est_seconds": 600}, "gpus"),
])
def test_a_request_refuses_values_that_break_admission_later(kwargs, field):
    with pytest.raises(InvalidAIRequest, match=rf"\b{field}: "):
        ai_task(**{"kind": "training", **kwargs})(lambda: None)


def test_a_fraction_of_a_gpu_has_a_smallest_size():
    assert GPURequest(gpus=0.01).fractional
    with pytest.raises(ValidationError, match="smallest share of a device, 0.01"):
        GPURequest(gpus=0.001)
