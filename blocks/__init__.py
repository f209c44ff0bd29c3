"""Prefect Blocks an operator edits in the UI, with pure checks on their data."""

from blocks.approval import ApprovalOutcome, ApprovalPolicyBlock, ApprovalRule, evaluate
from blocks.authority import AuthorityBlock, AuthorityDecision, Grant, authorize, utc
from blocks.budget import (
    MAX_AMOUNT,
    BudgetBlock,
    BudgetLimit,
    BudgetLine,
    CostEstimate,
    UnpriceableRequest,
    Usage,
    period_key,
)
from blocks.cluster import ClusterBlock, ModelLimit
from blocks.delegation import ChainBroken, DelegationRefused, delegate, resolve_chain, violations
from blocks.facts import RunFacts

__all__ = [
    "MAX_AMOUNT",
    "ApprovalOutcome",
    "ApprovalPolicyBlock",
    "ApprovalRule",
    "AuthorityBlock",
    "AuthorityDecision",
    "BudgetBlock",
    "BudgetLimit",
    "BudgetLine",
    "ChainBroken",
    "ClusterBlock",
    "CostEstimate",
    "DelegationRefused",
    "Grant",
    "ModelLimit",
    "RunFacts",
    "UnpriceableRequest",
    "Usage",
    "authorize",
    "delegate",
    "evaluate",
    "period_key",
    "resolve_chain",
    "utc",
    "violations",
]
