"""Model-call limits: a batch of LLM calls respects a provider's concurrency and rate limits, across flow runs."""

from __future__ import annotations

import time

import pytest
from prefect import flow
from pydantic import ValidationError

from aisched_prefect import Ledger, ai_task
from blocks import ClusterBlock, ModelLimit
from flows.batch_inference import most_at_once
from tests.helpers import runner

pytestmark = pytest.mark.usefixtures("prefect_api")


@ai_task(kind="model-call", model="gpt-x", est_tokens=100)
def call(i):
    start = time.time()
    time.sleep(0.5)
    return start, time.time()


def test_concurrency_limit_caps_calls_in_flight(gpu_cluster, sqlite_url):
    cluster = ClusterBlock(model_limits=[ModelLimit(model="gpt-*", concurrency=2)])

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, cluster=cluster, max_workers=8))
    def batch():
        return [f.result() for f in call.map(range(6))]

    spans = batch()
    assert most_at_once(spans) == 2  # never more, and the limit is used
    waited = [r.payload["model_limit"]["waited"] for r in Ledger(sqlite_url).records() if r.kind == "settlement"]
    assert len(waited) == 6 and max(waited) > 0.4


def test_rate_limit_spaces_calls(gpu_cluster, sqlite_url):
    cluster = ClusterBlock(model_limits=[ModelLimit(model="gpt-x", per_minute=120)])  # one every 0.5 s

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, cluster=cluster, max_workers=8))
    def batch():
        return [f.result() for f in call.map(range(5))]

    starts = sorted(s for s, _ in batch())
    assert starts[-1] - starts[0] >= 1.6  # 5 calls at 2 per second: at least 4 gaps of ~0.5 s


def test_other_models_and_kinds_are_not_limited(gpu_cluster, sqlite_url):
    cluster = ClusterBlock(model_limits=[ModelLimit(model="claude-*", concurrency=1)])

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, cluster=cluster, max_workers=8))
    def batch():
        return [f.result() for f in call.map(range(4))]

    assert most_at_once(batch()) >= 3


def test_a_limit_that_limits_nothing_names_its_fields():
    with pytest.raises(ValidationError, match="set concurrency, per_minute, or both"):
        ModelLimit(model="gpt-*")


def test_a_tenant_weight_of_zero_is_refused_naming_the_field():
    from blocks import ClusterBlock

    with pytest.raises(ValidationError, match=r"tenant_weights \{'team-b': 0\.0\}: every weight must be above 0"):
        ClusterBlock(tenant_weights={"team-a": 2.0, "team-b": 0.0})
