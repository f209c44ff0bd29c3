"""The approval desk of one runner session: asks people, counts their answers, batches concurrent asks.

Tasks of one flow run that need a person at about the same time (a `.map()`
over approval-needing tasks, or several `.submit()`s) are asked *once*: the
first to arrive waits `BATCH_SECONDS` for the others, then one pause shows
every item and their total cost; the answer is bound to a digest of all the
items' digests, and each item records its own decision. One pause at a time
per flow run is also what Prefect can show.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aisched_prefect.approvals import ApprovalDecision, ApprovalRequest, Approver, signature_valid
from blocks import Grant, RunFacts

logger = logging.getLogger("aisched_prefect")

BATCH_SECONDS = 0.5
REQUESTED_EVENT = "aisched.approval.requested"
DECIDED_EVENT = "aisched.approval.decided"


@dataclass
class Vote:
    """One answer after checking: whether it counts, and what the evidence should say about it."""

    decision: ApprovalDecision
    extra: dict[str, Any]


@dataclass
class Verdict:
    """What the desk decided for a batch: approved by whom, or the answer that ended it."""

    approved: bool
    final: Vote
    approved_by: dict[str, dict[str, Any]] = field(default_factory=dict)
    votes: list[tuple[Vote, bool]] = field(default_factory=list)  # (vote, counted) before the final one
    ask: ApprovalRequest | None = None
    error: BaseException | None = None  # the wait itself failed (cancelled, interrupted)


@dataclass
class _Batch:
    items: list[tuple[ApprovalRequest, RunFacts]] = field(default_factory=list)
    closed: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    verdict: Verdict | None = None


def batch_digest(digests: list[str]) -> str:
    return hashlib.sha256("\n".join(sorted(digests)).encode()).hexdigest()


class ApprovalDesk:
    """Collects people's answers for one session's runs; the session records and settles."""

    def __init__(self, approver: Approver, approver_grant: Callable[[str, RunFacts], list[Grant] | None],
                 approver_keys: Callable[[], dict[str, str]], hook: Any = None,
                 on_batch: Callable[[ApprovalRequest], None] | None = None) -> None:
        self.approver, self.approver_grant, self.approver_keys, self.hook = approver, approver_grant, approver_keys, hook
        self.on_batch = on_batch  # told of each batch of two or more before it is asked (the CLI finds it so)
        self._batches: dict[str, _Batch] = {}
        self._lock = threading.Lock()

    # -- batching -----------------------------------------------------------------------
    def ask(self, ask: ApprovalRequest, facts: RunFacts) -> tuple[Verdict, list[ApprovalRequest]]:
        """Wait for the decision covering this run; returns it and every item it covered."""
        with self._lock:
            batch = self._batches.get(ask.flow_run_id)
            leader = batch is None or batch.closed
            if leader:
                batch = self._batches[ask.flow_run_id] = _Batch()
            assert batch is not None
            batch.items.append((ask, facts))
        if leader:
            time.sleep(BATCH_SECONDS)  # let the other tasks of a .map() join
            with self._lock:
                batch.closed = True
                if self._batches.get(ask.flow_run_id) is batch:
                    del self._batches[ask.flow_run_id]
            try:
                combined = self._combined(batch.items)
                if combined.items and self.on_batch is not None:
                    self.on_batch(combined)
                batch.verdict = self._decide(combined, [f for _, f in batch.items])
            except BaseException as exc:
                batch.verdict = Verdict(approved=False, final=Vote(ApprovalDecision(
                    approved=False, approver="(none)", channel="aborted", reason=f"the wait was interrupted: {exc!r}"), {}),
                    error=exc)
            finally:
                batch.done.set()
        else:
            batch.done.wait()
        assert batch.verdict is not None
        return batch.verdict, [a for a, _ in batch.items]

    @staticmethod
    def _combined(items: list[tuple[ApprovalRequest, RunFacts]]) -> ApprovalRequest:
        """One request for a batch: all items, their total cost, the strictest of their rules."""
        asks = [a for a, _ in items]
        first = asks[0]
        if len(asks) == 1:
            return first
        money = [a.remaining_budget for a in asks if a.remaining_budget is not None]
        return first.model_copy(update={
            "task_name": f"{first.task_name} (batch of {len(asks)})",
            "est_cost": sum(a.est_cost for a in asks),
            "remaining_budget": min(money) if money else None,
            "rule": ", ".join(sorted({str(a.rule) for a in asks})),
            "timeout_seconds": min(a.timeout_seconds for a in asks),
            "approvals_required": max(a.approvals_required for a in asks),
            "require_signature": any(a.require_signature for a in asks),
            "digest": batch_digest([a.digest for a in asks]),
            "items": [{"task_run_id": a.task_run_id, "task": a.task_name, "request": a.request, "est_cost": a.est_cost}
                      for a in asks],
        })

    # -- one decision -------------------------------------------------------------------
    def _decide(self, ask: ApprovalRequest, facts: list[RunFacts]) -> Verdict:
        """Collect answers until the quorum; a counted rejection, or silence, ends it."""
        deadline = time.monotonic() + ask.timeout_seconds
        approved: dict[str, dict[str, Any]] = {}
        votes: list[tuple[Vote, bool]] = []
        self.announce(REQUESTED_EVENT, ask, {"digest": ask.digest, "est_cost": ask.est_cost,
                                             "approvals_required": ask.approvals_required,
                                             "items": [i["task_run_id"] for i in ask.items] or [ask.task_run_id]})
        while True:
            remaining = int(deadline - time.monotonic())
            current = ask.model_copy(update={"approved_by": list(approved), "round": len(votes),
                                             "timeout_seconds": max(remaining, 1)})
            answer = self.approver.decide(current) if remaining > 0 else ApprovalDecision(
                approved=False, approver="timeout", channel="timeout", reason="")
            if answer.approver == "timeout":  # said with the whole wait, not what was left of it
                answer = answer.model_copy(update={"reason": f"no decision within {ask.timeout_seconds}s: silence denies"})
            vote = self.check(answer, current, facts)
            self.announce(DECIDED_EVENT, current, {"approver": vote.decision.approver, "approved": vote.decision.approved,
                                                   "reason": vote.decision.reason, **vote.extra})
            if not vote.decision.approved:
                return Verdict(approved=False, final=vote, approved_by=approved, votes=votes, ask=ask)
            if vote.decision.approver in approved:
                votes.append((vote, False))
                continue
            approved[vote.decision.approver] = vote.extra
            if len(approved) >= ask.approvals_required:
                return Verdict(approved=True, final=vote, approved_by=approved, votes=votes, ask=ask)
            votes.append((vote, True))

    def check(self, answer: ApprovalDecision, ask: ApprovalRequest, facts: list[RunFacts]) -> Vote:
        """Whether one answer counts; an answer that does not is a rejection that says why.

        It counts only from a named person other than the requester, who holds
        (through a valid chain) a grant with the right to approve every run it
        covers, and, when that person has a key in the AuthorityBlock or the rule
        asks for signatures, whose signature covers exactly this request's digest.
        """
        if answer.channel in ("policy", "timeout") or answer.approver == "timeout":
            return Vote(answer, {})
        said = f"their answer was {'approve' if answer.approved else 'reject'}: {answer.reason}"

        def refuse(why: str) -> Vote:
            return Vote(answer.model_copy(update={"approved": False, "reason": f"{why} ({said})"}), {"verified": False})

        if not answer.approver or answer.approver == ask.principal:
            return refuse("the requester cannot approve its own run, and an approver must give a name")
        chains = [self.approver_grant(answer.approver, f) for f in facts]
        if any(c is None for c in chains):
            return refuse(f"{answer.approver!r} holds no grant with the right to approve this run")
        extra: dict[str, Any] = {"approver_chain": [g.id for g in chains[0] or []], "verified": False}
        key = self.approver_keys().get(answer.approver)
        if key is not None or answer.signature:
            if key is None:
                return refuse(f"{answer.approver!r} signed, but has no key in the AuthorityBlock's approver_keys")
            if not answer.signature:
                return refuse(f"an unsigned answer in the name of {answer.approver!r}, who has a key: "
                              f"use `aisched approve {ask.task_run_id} --as {answer.approver} --key KEY`")
            if not signature_valid(key, ask.digest, answer):
                return refuse(f"the signature of {answer.approver!r} does not match this request (digest "
                              f"{ask.digest[:12]}...): it was made for another request, or this one changed")
            extra["verified"] = True
        elif ask.require_signature:
            return refuse(f"rule {ask.rule!r} counts only signed approvals, and {answer.approver!r} has no key "
                          "in the AuthorityBlock's approver_keys")
        return Vote(answer, extra)

    def announce(self, event: str, ask: ApprovalRequest, payload: dict[str, Any]) -> None:
        """A Prefect event for every approval request and decision, so automations can notify people."""
        try:
            from prefect.events import emit_event

            emit_event(event=event, resource={
                "prefect.resource.id": f"aisched.approval.{ask.task_run_id}", "prefect.resource.name": ask.task_name,
                "aisched.principal": ask.principal, "aisched.rule": str(ask.rule)}, payload=payload)
        except Exception:
            logger.exception("could not emit %s", event)
        if self.hook is not None and event == REQUESTED_EVENT:
            try:
                if isinstance(self.hook, str):
                    import httpx

                    httpx.post(self.hook, json={"event": event, **ask.model_dump(mode="json")}, timeout=10)
                else:
                    self.hook(ask)
            except Exception:  # a chat hook that fails must not decide the run
                logger.exception("approval hook failed")
