"""Blocks and runners the flow tests build on."""

from __future__ import annotations

from typing import Any

from aisched_prefect import AISchedTaskRunner
from blocks import ApprovalPolicyBlock, ApprovalRule, AuthorityBlock, BudgetBlock, Grant


APPROVERS = [Grant(id=f"{name}-approves", principal=name, kinds=["training"], max_gpus=8, max_cost_per_run=100.0,
                   can_approve=True) for name in ("alice", "bob")]


def authority(**grant: Any) -> AuthorityBlock:
    """team-a's root grant (overridable), plus two people who may approve training runs."""
    fields = {"id": "team-a-root", "principal": "team-a/*", "max_gpus": 4, "max_cost_per_run": 10.0}
    return AuthorityBlock(grants=[Grant(**{**fields, **grant}), *APPROVERS])


def budget(limit: float = 100.0) -> BudgetBlock:
    return BudgetBlock(limit=limit, gpu_hour_prices={"H100": 4.0, "A10": 1.0}, token_prices_per_1k={"*": 0.01})


def runner(address: str, ledger_url: str, **kw: Any) -> AISchedTaskRunner:
    options: dict[str, Any] = {
        "principal": "team-a/nightly", "authority": authority(), "budget": budget(),
        "address": address, "ledger_url": ledger_url,
    }
    options.update(kw)
    return AISchedTaskRunner(**options)


def ask_for_training(timeout: int = 60) -> ApprovalPolicyBlock:
    return ApprovalPolicyBlock(rules=[ApprovalRule(name="training-needs-a-person", kinds=["training"])],
                               timeout_seconds=timeout)
