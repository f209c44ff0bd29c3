"""The admission stages, each a pure check over a snapshot: no database, no Dask, no Prefect.

The order is the life of one run (docs/concepts.md): configuration, feasibility,
pricing, authority, approval policy, then the budget lines a hold must fit.
Each stage returns what the next needs or raises `AdmissionDenied(stage, reason,
fix)`; the admission phases (phases.py) call them, in the order pipeline.py runs
them; the watcher, settlement and delegation reuse them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime, timezone

from aisched_prefect.control.authority.identity import Credential
from aisched_prefect.control.authority.state import Applied, Snapshot
from aisched_prefect.errors import AdmissionDenied
from aisched_prefect.request import AIRequest
from blocks import (
    ApprovalOutcome,
    BudgetBlock,
    BudgetLine,
    ChainBroken,
    CostEstimate,
    Grant,
    RunFacts,
    UnpriceableRequest,
    Usage,
    resolve_chain,
)
from dask_gpu import InfeasibleRequest, WorkerInventory, eligible_workers


@dataclass(frozen=True)
class Bound:
    """The applied configuration a caller's credential binds it to."""

    authority: Applied
    budget: Applied
    policy: Applied | None
    cluster: Applied | None

    @property
    def versions(self) -> dict[str, str]:
        return {a.kind: a.ref for a in (self.authority, self.budget, self.policy, self.cluster) if a is not None}


def configuration(snap: Snapshot, cred: Credential) -> Bound:
    """Stage 0: the authority, budget, policy and cluster configuration this caller runs under."""
    found: dict[str, Applied | None] = {}
    for kind, name, needed in (("authority", cred.authority, True), ("budget", cred.budget, True),
                               ("policy", cred.policy, False), ("cluster", cred.cluster, False)):
        applied = snap.config(kind, name)
        if name is not None and applied is None:
            raise AdmissionDenied("configuration", f"no {kind} configuration {name!r} has been applied on this control "
                                  f"plane (the credential of {cred.principal!r} names it)",
                                  f"an operator applies it: aisched apply --{kind} {name}")
        if needed and applied is None:
            raise AdmissionDenied("configuration", f"the credential of {cred.principal!r} names no {kind} configuration",
                                  f"issue a credential with --{kind} NAME")
        found[kind] = applied
    return Bound(found["authority"], found["budget"], found["policy"], found["cluster"])  # type: ignore[arg-type]


def feasibility(request: AIRequest, inventories: dict[str, WorkerInventory],
                tenant: str | None = None) -> tuple[list[str], list[str]]:
    """Stage 1: the workers that could ever hold the request, and the GPU types it could land on: only workers that
    serve the caller's tenant (a worker started for one tenant, `--tenant`, refuses every other's run)."""
    gpu_request = request.gpu_request()
    if gpu_request.gpus:
        theirs = {name: inv for name, inv in inventories.items() if inv.serves(tenant)}
        if inventories and not theirs:
            raise AdmissionDenied("feasibility", f"no worker serves tenant {tenant!r}: every worker was started for "
                                  f"another tenant ({', '.join(sorted({str(i.tenant) for i in inventories.values()}))})",
                                  f"start a worker for {tenant!r} (dask-gpu-worker --tenant {tenant}), or one that "
                                  "isolates tenants (as root with bubblewrap)")
        inventories = theirs
    have: dict[str, int] = {}
    for inv in inventories.values():
        for d in inv.devices:
            have[d.gpu_type] = have.get(d.gpu_type, 0) + 1
    if gpu_request.gpus and gpu_request.types and have and not set(gpu_request.types) & {t.upper() for t in have}:
        wanted = " or ".join(repr(t) for t in gpu_request.types)
        raise AdmissionDenied("feasibility", f"no worker has GPU type {wanted} (the cluster has: "
                              f"{', '.join(f'{t} x{n}' for t, n in sorted(have.items()))})",
                              f"ask for gpu_type one of {', '.join(sorted(have))} (or leave gpu_type out), "
                              f"or add a worker with {wanted} GPUs")
    try:
        workers = eligible_workers(gpu_request, inventories)
    except InfeasibleRequest as exc:
        raise AdmissionDenied("feasibility", str(exc), "ask for what some worker has, or add such a worker") from None
    types = sorted({d.gpu_type for w in workers for d in inventories[w].devices if gpu_request.device_fits(d)})
    return workers, types


def pricing(budget: Applied, request: AIRequest, types: list[str]) -> CostEstimate:
    """Stage 2: the estimated cost; a request the budget cannot price is refused, never waved through."""
    block: BudgetBlock = budget.model
    try:
        return block.estimate(request.gpus, request.est_seconds, types, request.est_tokens, request.model)
    except UnpriceableRequest as exc:
        raise AdmissionDenied("pricing", str(exc), f"an operator adds the price to budget {budget.name!r} and "
                              "applies it") from None


def chain_of(snap: Snapshot, authority: Applied, grant_id: str, now: datetime | None = None) -> list[Grant]:
    """The chain root -> ... -> grant, as the applied authority and the chain's delegations and revocations say."""
    idx = snap.index(authority)
    return resolve_chain(grant_id, idx.roots, snap.delegated_in(authority), snap.revoked_in(authority), now)


def authority(snap: Snapshot, bound: Bound, facts: RunFacts, grant: str | None) -> list[Grant]:
    """Stage 3: the chain of grants, root first, that authorizes this run.

    A principal's authority is the grants issued to it (by name, or through a
    group an operator declared) and the grants delegated to it, nothing else:
    with `grant=` exactly that one; without, the first of them that covers the run.
    """
    held = snap.grants_of(bound.authority, facts.principal)
    fix = f"an operator grants {facts.principal!r} what this run needs (aisched apply), or a holder delegates it"
    if grant is not None:
        if grant not in {g.id for g in held}:
            raise AdmissionDenied("authority", f"principal {facts.principal!r} does not hold grant {grant!r}", fix)
        candidates = [g for g in held if g.id == grant]
    else:
        candidates = held
    if not candidates:
        raise AdmissionDenied("authority", f"principal {facts.principal!r} holds no grant", fix)
    reasons = []
    for g in candidates:
        try:
            chain = chain_of(snap, bound.authority, g.id)
        except ChainBroken as exc:
            reasons.append(f"grant chain of {g.id!r} is broken: {exc}")
            continue
        why = chain[-1].refusal(facts)
        if why is None:
            return chain
        reasons.append(why)
    raise AdmissionDenied("authority", "; ".join(reasons), fix)


def policy(bound: Bound, facts: RunFacts) -> ApprovalOutcome | None:
    """Stage 4: what the approval policy says (None: no policy, approved without asking)."""
    if bound.policy is None:
        return None
    outcome = bound.policy.model.evaluate(facts)
    if outcome.action == "deny":
        raise AdmissionDenied("approval", f"approval policy rule {outcome.rule!r} denies this run",
                              f"change the request, or an operator changes the rule in policy {bound.policy.name!r}")
    return outcome


def lines(bound: Bound, facts: RunFacts, usage: Usage, shares: dict[str, float], now: datetime) -> list[BudgetLine]:
    """Stage 5: every account the hold must fit: the budget's covering limits, and for each grant of the
    chain with a budget_share below 1, that share of each of them as an account of its own (`<account>#<grant>`).
    `now`: the ledger's (database) clock, which names the calendar period every replica charges."""
    budget: BudgetBlock = bound.budget.model
    out = budget.lines(bound.budget.name, facts, usage, now=now, config_version=config_version(bound))
    return out + [line.model_copy(update={"budget": f"{line.budget}#{gid}", "limit": line.limit * share})
                  for gid, share in shares.items() for line in out]


def config_version(bound: Bound) -> int:
    """The version stamped on a run's budget lines: it grows whenever the budget or the authority is applied again
    (grant-share accounts take their limits from both), so the ledger never lets an older one undo a newer limit."""
    return bound.budget.version + bound.authority.version


def version_of(grant: Grant) -> str:
    """Short content hash: which version of a grant decided, as the evidence records it."""
    return hashlib.sha256(grant.model_dump_json().encode()).hexdigest()[:12]


def expected_usage(request: AIRequest, money: float) -> Usage:
    """What a run is expected to use, as its holds are sized."""
    return Usage(money=money, gpu_hours=request.gpus * request.est_seconds / 3600, tokens=request.est_tokens)


def earliest_expiry(chain: list[Grant]) -> float | None:
    from blocks import utc

    return min((utc(g.expires_at).timestamp() for g in chain if g.expires_at), default=None)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)
