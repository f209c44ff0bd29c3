"""Who may run what: root grants an operator edits in the Prefect UI, and the pure check."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import ClassVar

from prefect.blocks.core import Block
from pydantic import BaseModel, ConfigDict, Field

from blocks.facts import RunFacts

ANY = "*"
GROUP = "group:"


class Grant(BaseModel):
    """Authority for one principal (or a glob of them) over a bounded kind of work."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(description="A stable name for this grant, recorded in the evidence of every run it authorizes.")
    principal: str = Field(description="Who holds this grant: one principal ('team-a/nightly'), or 'group:NAME' for "
                           "every member of a group declared in the block's groups.")
    kinds: list[str] = Field(default_factory=lambda: [ANY], description="Task kinds allowed ('training', 'inference', 'model-call', ...); '*' allows any.")
    models: list[str] = Field(default_factory=lambda: [ANY], description="Models allowed; '*' allows any.")
    gpu_types: list[str] = Field(default_factory=lambda: [ANY], description="GPU types allowed; '*' allows any.")
    max_gpus: int = Field(default=0, ge=0, description="Most GPUs one run may hold.")
    max_cost_per_run: float = Field(default=0.0, ge=0, description="Most estimated cost one run may have, in the budget's currency.")
    expires_at: datetime | None = Field(default=None, description="After this instant the grant authorizes nothing.")
    revoked: bool = Field(default=False, description="A revoked grant authorizes nothing.")
    budget_share: float = Field(default=1.0, ge=0, le=1, description="Largest share of each covering budget this grant's runs may hold, from 0 to 1.")
    max_priority: int = Field(default=0, ge=0, le=100, description="Highest queue priority its runs may take; a request asking more is capped to it.")
    can_delegate: bool = Field(default=False, description="Whether the holder may delegate narrower grants to others.")
    can_approve: bool = Field(default=False, description="Whether the holder may approve runs within this grant's scope.")
    parent: str | None = Field(default=None, description="Id of the grant this one was delegated from; empty for a root grant.")

    def held_by(self, principal: str, groups: dict[str, list[str]]) -> bool:
        """Whether `principal` holds this grant: named exactly, or a member of the group it names.

        >>> g = Grant(id="r", principal="group:team-a")
        >>> g.held_by("team-a/nightly", {"team-a": ["team-a/nightly"]}), g.held_by("team-a/other", {"team-a": []})
        (True, False)
        """
        if self.principal.startswith(GROUP):
            return principal in groups.get(self.principal[len(GROUP):], [])
        return principal == self.principal

    def refusal(self, facts: RunFacts, now: datetime | None = None) -> str | None:
        """Why this grant does not cover `facts`, or None when it does."""
        now = now or datetime.now(timezone.utc)
        if self.revoked:
            return f"grant {self.id!r} is revoked"
        if self.expires_at is not None and now >= utc(self.expires_at):
            return f"grant {self.id!r} expired at {utc(self.expires_at).isoformat()}"
        if not _allowed(facts.kind, self.kinds):
            return f"grant {self.id!r} allows kinds {self.kinds}, not kind={facts.kind!r}"
        if facts.model is None and ANY not in self.models:
            return f"grant {self.id!r} allows only models {self.models}, and the task declares none: set model="
        if facts.model is not None and not _allowed(facts.model, self.models):
            return f"grant {self.id!r} allows models {self.models}, not model={facts.model!r}"
        outside = [t for t in facts.gpu_types if not _allowed(t, self.gpu_types)] if facts.gpus else []
        if outside:
            return (f"grant {self.id!r} allows GPU types {self.gpu_types}, but the run could land on {outside}: "
                    "set gpu_type= on the task to allowed types")
        if facts.gpus > self.max_gpus:
            return f"grant {self.id!r} allows at most max_gpus={self.max_gpus}, not gpus={facts.gpus:g}"
        if facts.est_cost is not None and facts.est_cost > self.max_cost_per_run:
            return (
                f"grant {self.id!r} allows at most max_cost_per_run={self.max_cost_per_run:g}, "
                f"not an estimated {facts.est_cost:.4f}"
            )
        return None


def utc(moment: datetime) -> datetime:
    """Naive datetimes in grants are read as UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def _allowed(value: str, allowed: list[str]) -> bool:
    return ANY in allowed or value.lower() in {a.lower() for a in allowed}


class AuthorityDecision(BaseModel):
    """The grant that authorized a run, or why none did."""

    model_config = ConfigDict(frozen=True)

    grant: Grant | None
    reasons: list[str] = Field(default_factory=list)

    @property
    def allowed(self) -> bool:
        return self.grant is not None


def authorize(grants: list[Grant], facts: RunFacts, now: datetime | None = None,
              groups: dict[str, list[str]] | None = None) -> AuthorityDecision:
    """The first grant this principal holds (by name, or through a group) that covers the run; otherwise every refusal."""
    mine = [g for g in grants if g.held_by(facts.principal, groups or {})]
    if not mine:
        return AuthorityDecision(grant=None, reasons=[f"principal {facts.principal!r} holds no grant"])
    reasons = []
    for g in mine:
        why = g.refusal(facts, now)
        if why is None:
            return AuthorityDecision(grant=g)
        reasons.append(why)
    return AuthorityDecision(grant=None, reasons=reasons)


class AuthorityBlock(Block):
    """Root grants of one tenant: who may run which AI work, on what, up to what cost."""

    _block_type_name: ClassVar[str] = "AI Authority"
    _block_type_slug: ClassVar[str] = "aisched-authority"
    _logo_url = None
    _description: ClassVar[str] = "Root grants that authorize AI task runs scheduled by aisched-prefect."
    _documentation_url = "https://github.com/aisched/aisched-prefect/blob/main/docs/how-to/authority.md"
    _code_example: ClassVar[str] = '''
```python
from blocks import AuthorityBlock, Grant

authority = AuthorityBlock(grants=[Grant(id="team-a-root", principal="group:team-a", max_gpus=4, max_cost_per_run=50)],
                           groups={"team-a": ["team-a/nightly", "team-a/etl"]})
authority.save("team-a", overwrite=True)
authority = AuthorityBlock.load("BLOCK_NAME")
```
'''

    grants: list[Grant] = Field(default_factory=list, description="Root grants; a run is authorized by the first grant for its principal that covers it.")
    groups: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Named groups of principals (name -> exact principals); a grant to 'group:NAME' is held by each member.")
    approver_keys: dict[str, str] = Field(
        default_factory=dict,
        description="Public Ed25519 keys of approvers (name -> hex, from `aisched approvals keygen`): "
                    "an approval signed with the matching private key proves who decided.")

    def authorize(self, facts: RunFacts, now: datetime | None = None) -> AuthorityDecision:
        return authorize(self.grants, facts, now, self.groups)

    def problems(self) -> list[str]:
        """What a control plane refuses to apply: grants to patterns, unknown groups, duplicate ids."""
        return authority_problems(self.grants, self.groups)


_PATTERN = set("*?[")


def authority_problems(grants: list[Grant], groups: dict[str, list[str]]) -> list[str]:
    """Every reason these root grants cannot be applied; empty when they can.

    A grant names exactly who holds it: one principal, or a group whose members an
    operator listed. A pattern such as 'team-a/*' would hand authority to principals
    nobody named, so it is refused.

    >>> authority_problems([Grant(id="r", principal="team-a/*")], {})[0][:40]
    "grants['r'].principal='team-a/*' is a pa"
    """
    out: list[str] = []
    seen: set[str] = set()
    for g in grants:
        if g.id in seen:
            out.append(f"grants: two grants have id {g.id!r}; give each a unique id")
        seen.add(g.id)
        if g.parent is not None:
            out.append(f"grants[{g.id!r}].parent={g.parent!r}: root grants have no parent (delegate with `aisched grants delegate`)")
        if g.principal.startswith(GROUP):
            name = g.principal[len(GROUP):]
            if name not in groups:
                out.append(f"grants[{g.id!r}].principal={g.principal!r}: no group {name!r} in groups "
                           f"(known: {sorted(groups)}); declare its members")
        elif _PATTERN & set(g.principal):
            out.append(f"grants[{g.id!r}].principal={g.principal!r} is a pattern: name one principal, or declare a "
                       f"group (groups={{'team-a': ['team-a/nightly', ...]}}) and name 'group:team-a'")
    for name, members in groups.items():
        for m in members:
            if not m or m != m.strip() or _PATTERN & set(m) or m.startswith(GROUP):
                out.append(f"groups[{name!r}]: member {m!r} must be one exact principal")
    return out
