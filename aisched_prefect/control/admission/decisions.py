"""One decision per map: the elements of a `.map()` share the decision of feasibility, pricing, authority and the
approval policy, as Slurm admits a job array.

The elements of a `.map()` are one request in all but their arguments: the same credential, task, request,
grant and code, over the same snapshot of authority. Their decision is taken once and reused while the
snapshot is the same object (any authority record, a revocation or an apply, makes a new one), for at most
DECISION_SECONDS (the inventories feasibility reads are that fresh), never past the chain's earliest expiry
nor, under a policy with a rule by hours_utc, a whole UTC hour (where that rule turns). Budget is not part of
it: each element holds its own and has its own admission record, naming the element whose admission decided it
(`decided_with`); a decision is kept once its decider's hold is taken, and a map's later shards the queue starts
hold as it starts them (pipeline.holds_at_start). A decision that asks a person is never reused: each call is
asked on its own.

A `.map()` the flow marks as one array (`CallMeta.array`) is decided once for all its shards: the first shard's
admission takes the decision while the others wait for it (one lock per array), and it holds for the array's
life (ARRAY_SECONDS, the hour and the chain's expiry still bound it; a new snapshot still ends it). Where the
policy asks a person, the first shard's request is the whole array's: the shards after it wait on that one
request, and once it is approved each takes its own hold and admission record naming it (`map_approval`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from aisched_prefect.control.admission import stages
from aisched_prefect.control.admission.phases import Case, Phase
from aisched_prefect.control.authority.state import Snapshot

DECISION_SECONDS = 2.0  # how long a map's elements share one decision (feasibility reads inventories this fresh)
ARRAY_SECONDS = 600.0  # how long the shards of one array share its decision (Slurm admits a job array once)
MAX_DECISIONS = 4096
SHARED = frozenset({Phase.FEASIBILITY, Phase.PRICING, Phase.AUTHORITY, Phase.APPROVAL})


@dataclass(frozen=True)
class _Kept:
    snap: Snapshot
    until: float
    decided_with: str  # the task run whose admission took this decision
    case: Case  # its findings of the shared phases
    said: dict[str, Any]  # what its record says of them (computed once: the grants' versions are hashes)
    approval: str | None = None  # an array whose decision asks a person: the one request all its shards wait on


class Decisions:
    """The decisions a map's later elements reuse (one control plane's, shared by its admission threads)."""

    def __init__(self) -> None:
        self._kept: dict[tuple[Any, ...], _Kept] = {}
        self._lock = threading.Lock()
        self._deciding: dict[tuple[Any, ...], threading.Lock] = {}  # an array's shards wait for its first's decision

    @staticmethod
    def _key(case: Case) -> tuple[Any, ...] | None:
        meta = case.meta
        if meta is None or case.prior is not None or case.cred is None:
            return None
        return (case.cred.id, meta.task_name, meta.flow_name, meta.grant, meta.approver, case.digests["function"],
                case.first_of_version, case.request.model_dump_json(), meta.array.id if meta.array else None)

    def deciding(self, case: Case) -> threading.Lock | None:
        """The lock the shards of one array take while its decision is taken (None: not a shard of an array)."""
        key = self._key(case)
        if key is None or key[-1] is None:
            return None
        with self._lock:
            if len(self._deciding) >= MAX_DECISIONS:
                self._deciding = {k: v for k, v in self._deciding.items() if v.locked()}
            return self._deciding.setdefault(key, threading.Lock())

    def approval_of(self, snap: Snapshot, case: Case) -> str | None:
        """The request a person is asked for this array (its shards wait on it), or None."""
        key = self._key(case)
        with self._lock:
            kept = self._kept.get(key) if key is not None else None
        return kept.approval if kept is not None and kept.snap is snap else None

    def reuse(self, snap: Snapshot, case: Case) -> Case:
        """The case with the shared phases decided as the element before it decided them, when that decision holds
        for it (same key, same snapshot, still fresh); else the case as it came."""
        key = self._key(case)
        if key is None:
            return case
        with self._lock:
            kept = self._kept.get(key)
        if kept is None or kept.snap is not snap or time.time() >= kept.until or kept.approval is not None:
            return case
        d = kept.case
        assert d.estimate is not None
        return replace(case, workers=d.workers, types=d.types, estimate=d.estimate, facts=d.facts, chain=d.chain,
                       priority=d.priority, idle=d.idle, outcome=d.outcome, decided=case.decided | SHARED,
                       payload={**case.payload, **kept.said, "decided_with": kept.decided_with})

    def keep(self, snap: Snapshot, case: Case, approval: str | None = None) -> None:
        """Keep a new call's decision for the elements after it (never one that asks a person, except an array's:
        then `approval` is the one request its shards wait on)."""
        key = self._key(case)
        if key is None or Phase.APPROVAL in case.decided or (case.asking and (approval is None or key[-1] is None)):
            return
        now = time.time()
        expiry = stages.earliest_expiry(case.chain)
        fresh = ARRAY_SECONDS if key[-1] is not None else DECISION_SECONDS
        bounds = [now + fresh] + ([expiry] if expiry is not None else [])
        # A rule by hours_utc turns at a whole hour; a case whose configuration was not read is bound as if one did.
        if case.bound is None or (case.bound.policy is not None and case.bound.policy.model.watches_hours):
            bounds.append((now // 3600 + 1) * 3600)
        until = min(bounds)
        assert case.meta is not None
        with self._lock:
            if len(self._kept) >= MAX_DECISIONS:
                self._kept.clear()
            said = {k: case.payload[k] for k in ("estimate", "grant", "chain", "grant_versions", "priority",
                                                 "approval_rule", "idle", "approval", "map_approval")
                    if k in case.payload}
            self._kept[key] = _Kept(snap, until, case.meta.task_run_id, case, said, approval)
