"""When a person must approve a run: the policy an operator edits, and its pure evaluation."""

from __future__ import annotations

from typing import ClassVar, Literal

from prefect.blocks.core import Block
from pydantic import BaseModel, ConfigDict, Field

from blocks.facts import RunFacts

Action = Literal["ask", "approve", "deny"]


class ApprovalRule(BaseModel):
    """A condition on a run and what to do when it holds. Unset conditions match anything."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(description="Name recorded with every decision this rule makes.")
    action: Action = Field(default="ask", description="'ask' a person, or decide at once: 'approve' or 'deny'.")
    min_cost: float | None = Field(default=None, ge=0, description="Matches runs whose estimated cost is at least this.")
    min_gpus: int | None = Field(default=None, ge=0, description="Matches runs asking for at least this many GPUs.")
    kinds: list[str] | None = Field(default=None, description="Matches runs of these kinds.")
    gpu_types: list[str] | None = Field(default=None, description="Matches runs on these GPU types.")
    models: list[str] | None = Field(default=None, description="Matches runs of these models.")
    principals: list[str] | None = Field(default=None, description="Matches runs of these principals.")

    def matches(self, facts: RunFacts) -> bool:
        if self.min_cost is not None and (facts.est_cost or 0.0) < self.min_cost:
            return False
        if self.min_gpus is not None and facts.gpus < self.min_gpus:
            return False
        if self.gpu_types is not None and not {t.lower() for t in facts.gpu_types} & {a.lower() for a in self.gpu_types}:
            return False  # matches when the run could land on one of these types
        for allowed, value in ((self.kinds, facts.kind), (self.models, facts.model), (self.principals, facts.principal)):
            if allowed is not None and (value is None or value.lower() not in {a.lower() for a in allowed}):
                return False
        return True


class ApprovalOutcome(BaseModel):
    """What the policy says about one run, and which rule said it."""

    model_config = ConfigDict(frozen=True)

    action: Action
    rule: str | None
    timeout_seconds: int


def evaluate(rules: list[ApprovalRule], facts: RunFacts, timeout_seconds: int) -> ApprovalOutcome:
    """The first matching rule decides; no match means approved without asking."""
    for rule in rules:
        if rule.matches(facts):
            return ApprovalOutcome(action=rule.action, rule=rule.name, timeout_seconds=timeout_seconds)
    return ApprovalOutcome(action="approve", rule=None, timeout_seconds=timeout_seconds)


class ApprovalPolicyBlock(Block):
    """Rules for when a person must approve an AI task run before it reserves GPUs."""

    _block_type_name: ClassVar[str] = "AI Approval Policy"
    _block_type_slug: ClassVar[str] = "aisched-approval-policy"
    _logo_url = None
    _description: ClassVar[str] = "Rules deciding which AI task runs need a person's approval, evaluated by aisched-prefect at admission."
    _documentation_url = "https://github.com/aisched/aisched-prefect#approvals"
    _code_example: ClassVar[str] = '''
```python
from blocks import ApprovalPolicyBlock, ApprovalRule

policy = ApprovalPolicyBlock(rules=[ApprovalRule(name="big-training", kinds=["training"], min_gpus=2)])
policy.save("team-a", overwrite=True)
policy = ApprovalPolicyBlock.load("BLOCK_NAME")
```
'''

    rules: list[ApprovalRule] = Field(default_factory=list, description="Rules in order; the first that matches a run decides.")
    timeout_seconds: int = Field(default=3600, gt=0, description="How long a run waits for a person; silence past it denies the run.")

    def evaluate(self, facts: RunFacts) -> ApprovalOutcome:
        return evaluate(self.rules, facts, self.timeout_seconds)
