"""Shared by the authority attack tests: the team's root grant and two AI tasks."""

from __future__ import annotations

from aisched_prefect import AdmissionDenied, ai_task
from blocks import AuthorityBlock, Grant

ROOT = AuthorityBlock(grants=[Grant(id="team-a-root", principal="team-a/*", max_gpus=4, max_cost_per_run=10,
                                    can_delegate=True)])


@ai_task(gpus=1, kind="inference", est_seconds=5)
def infer(i):
    return i


@ai_task(gpus=2, kind="training", est_seconds=20)
def train():
    return "trained"


def outcome(ai, *args):
    """Call an AI task in a flow: its result, or 'denied: ...' with the denial's message."""
    try:
        return ai(*args)
    except AdmissionDenied as exc:
        return f"denied: {exc}"
