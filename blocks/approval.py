"""When a person must approve a run: the policy an operator edits, and its pure evaluation."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import ClassVar, Literal

from prefect.blocks.core import Block
from pydantic import BaseModel, ConfigDict, Field, field_validator

from blocks.facts import RunFacts

Action = Literal["ask", "approve", "deny"]
_HOURS = re.compile(r"^([01]?\d|2[0-3])-([01]?\d|2[0-4])$")


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
    new_flow_version: bool = Field(default=False, description="Matches only runs of code never admitted before: the "
                                   "digest of the function's bytes the control plane received, per flow (a call with "
                                   "no flow name always matches).")
    hours_utc: str | None = Field(default=None, description="Matches runs asked for between these UTC hours, e.g. '18-8' (6 pm to 8 am).")
    approvals_required: int = Field(default=1, ge=1, le=10, description="'ask': how many different approvers must approve (k of n).")
    timeout_seconds: int | None = Field(default=None, gt=0, description="'ask': how long to wait; silence past it denies. Empty: the policy's.")
    require_signature: bool = Field(default=False, description="'ask': count only approvals signed with the approver's key (aisched approve).")

    @field_validator("hours_utc")
    @classmethod
    def _hours_shape(cls, v: str | None) -> str | None:
        if v is not None and not _HOURS.match(v.strip()):
            raise ValueError(f"hours_utc={v!r}: write 'FROM-TO' in whole UTC hours, e.g. '18-8' or '0-24'")
        return v

    def in_hours(self, now: datetime | None = None) -> bool:
        if self.hours_utc is None:
            return True
        start, end = (int(x) for x in self.hours_utc.split("-"))
        hour = (now or datetime.now(timezone.utc)).astimezone(timezone.utc).hour
        return start <= hour < end if start <= end else hour >= start or hour < end

    def matches(self, facts: RunFacts, now: datetime | None = None) -> bool:
        if not self.in_hours(now):
            return False
        if self.new_flow_version and not facts.first_of_version:
            return False
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
    approvals_required: int = 1
    require_signature: bool = False


def evaluate(rules: list[ApprovalRule], facts: RunFacts, timeout_seconds: int, now: datetime | None = None) -> ApprovalOutcome:
    """The first matching rule decides; no match means approved without asking."""
    for rule in rules:
        if rule.matches(facts, now):
            return ApprovalOutcome(action=rule.action, rule=rule.name, timeout_seconds=rule.timeout_seconds or timeout_seconds,
                                   approvals_required=rule.approvals_required, require_signature=rule.require_signature)
    return ApprovalOutcome(action="approve", rule=None, timeout_seconds=timeout_seconds)


class ApprovalPolicyBlock(Block):
    """Rules for when a person must approve an AI task run before it reserves GPUs."""

    _block_type_name: ClassVar[str] = "AI Approval Policy"
    _block_type_slug: ClassVar[str] = "aisched-approval-policy"
    _logo_url = None
    _description: ClassVar[str] = "Rules deciding which AI task runs need a person's approval, evaluated by aisched-prefect at admission."
    _documentation_url = "https://github.com/aisched/aisched-prefect/blob/main/docs/how-to/approvals.md"
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
    approval_hook: str | None = Field(
        default=None, description="An http(s) URL the control plane posts each request to, with a one-time link for "
        "each approver who may approve it (a chat or mail bridge delivers each link to its approver alone).")

    @field_validator("approval_hook")
    @classmethod
    def _hook_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"approval_hook={v!r}: give an http(s) URL the control plane can post each request to")
        return v

    @property
    def watches_flow_versions(self) -> bool:
        return any(rule.new_flow_version for rule in self.rules)

    @property
    def watches_hours(self) -> bool:
        """A rule matches by the UTC hour: a decision under this policy holds only until the hour turns."""
        return any(rule.hours_utc is not None for rule in self.rules)

    def evaluate(self, facts: RunFacts, now: datetime | None = None) -> ApprovalOutcome:
        return evaluate(self.rules, facts, self.timeout_seconds, now)
