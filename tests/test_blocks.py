"""The operator's blocks: Prefect's own conformance suite, save/load, registration, pure checks."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest
from prefect.testing.standard_test_suites import BlockStandardTestSuite

from blocks import (
    ApprovalPolicyBlock,
    ApprovalRule,
    AuthorityBlock,
    BudgetBlock,
    ClusterBlock,
    Grant,
    RunFacts,
    UnpriceableRequest,
    period_key,
)


class _Conformance(BlockStandardTestSuite):
    @pytest.mark.skip(reason="downloads the logo over the network, which this machine and CI cannot reach")
    def test_has_a_valid_image(self, block):  # pragma: no cover
        pass


class TestAuthorityBlock(_Conformance):
    @pytest.fixture
    def block(self):
        return AuthorityBlock


class TestBudgetBlock(_Conformance):
    @pytest.fixture
    def block(self):
        return BudgetBlock


class TestApprovalPolicyBlock(_Conformance):
    @pytest.fixture
    def block(self):
        return ApprovalPolicyBlock


class TestClusterBlock(_Conformance):
    @pytest.fixture
    def block(self):
        return ClusterBlock


@pytest.mark.usefixtures("prefect_api")
def test_blocks_save_and_load():
    AuthorityBlock(grants=[Grant(id="g", principal="team-a/*", max_gpus=2)]).save("t-auth", overwrite=True)
    BudgetBlock(limit=10, gpu_hour_prices={"H100": 4}).save("t-budget", overwrite=True)
    ApprovalPolicyBlock(rules=[ApprovalRule(name="r", min_gpus=2)]).save("t-policy", overwrite=True)
    assert AuthorityBlock.load("t-auth").grants[0].max_gpus == 2
    assert BudgetBlock.load("t-budget").gpu_hour_prices == {"H100": 4.0}
    assert ApprovalPolicyBlock.load("t-policy").rules[0].name == "r"


@pytest.mark.usefixtures("prefect_api")
def test_prefect_block_register_module():
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    out = subprocess.run([sys.executable, "-m", "prefect", "block", "register", "-m", "blocks"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Successfully registered 4 blocks" in out.stdout


FACTS = RunFacts(principal="team-a/nightly", kind="training", gpus=2, gpu_types=("H100",), est_seconds=3600, est_cost=8.0)


def test_grant_covers_and_refuses_by_dimension():
    g = Grant(id="g", principal="team-a/nightly", kinds=["training"], gpu_types=["H100"], max_gpus=2, max_cost_per_run=10)
    assert g.refusal(FACTS) is None
    assert "max_gpus=2" in g.refusal(FACTS.model_copy(update={"gpus": 4}))
    assert "max_cost_per_run" in g.refusal(FACTS.model_copy(update={"est_cost": 11}))
    assert "kinds" in g.refusal(FACTS.model_copy(update={"kind": "inference"}))
    assert "could land on ['A100']" in g.refusal(FACTS.model_copy(update={"gpu_types": ("H100", "A100")}))
    assert "revoked" in g.model_copy(update={"revoked": True}).refusal(FACTS)
    past = datetime.now(timezone.utc) - timedelta(seconds=1)
    assert "expired" in g.model_copy(update={"expires_at": past}).refusal(FACTS)
    assert g.held_by("team-a/nightly", {}) and not g.held_by("team-b/nightly", {})


def test_budget_prices_and_refuses_what_it_cannot_price():
    b = BudgetBlock(limit=10, gpu_hour_prices={"H100": 4.0}, token_prices_per_1k={"gpt-x": 0.5})
    assert b.estimate(2, 1800, ["H100"]).amount == 4.0
    assert b.estimate(0, 0, [], tokens=2000, model="gpt-x").amount == 1.0
    both = BudgetBlock(limit=10, gpu_hour_prices={"H100": 4.0, "A10": 1.0})
    assert both.estimate(1, 3600, ["A10", "H100"]).gpu_type_priced == "H100"  # dearest candidate
    with pytest.raises(UnpriceableRequest, match="no GPU-hour price for gpu_type='A10'"):
        b.estimate(1, 60, ["A10"])
    with pytest.raises(UnpriceableRequest, match="token price for model='other'"):
        b.estimate(0, 0, [], tokens=10, model="other")


def test_period_keys():
    t = datetime(2026, 11, 29, 23, 0, tzinfo=timezone.utc)
    assert [period_key(p, t) for p in ("daily", "weekly", "monthly", "total")] == ["2026-11-29", "2026-W48", "2026-11", "total"]


def test_approval_policy_first_matching_rule_decides():
    policy = ApprovalPolicyBlock(rules=[
        ApprovalRule(name="no-mi300", gpu_types=["MI300"], action="deny"),
        ApprovalRule(name="big", min_cost=5.0),
        ApprovalRule(name="small-ok", action="approve"),
    ])
    assert policy.evaluate(FACTS).rule == "big" and policy.evaluate(FACTS).action == "ask"
    assert policy.evaluate(FACTS.model_copy(update={"est_cost": 1.0})).action == "approve"
    assert policy.evaluate(FACTS.model_copy(update={"gpu_types": ("A100", "MI300")})).action == "deny"
    assert ApprovalPolicyBlock().evaluate(FACTS).action == "approve"
