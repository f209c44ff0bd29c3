"""A real flow pauses for approval and is resumed through the Prefect API, as the UI does."""

from __future__ import annotations

import threading
import uuid

import pytest
from prefect import flow

from aisched_prefect import AdmissionDenied, Ledger, ai_task
from tests.helpers import ask_for_training, resume_when_paused, runner

pytestmark = pytest.mark.usefixtures("prefect_api")


@ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=30)
def finetune():
    return "trained"


def run_paused_flow(address: str, ledger_url: str, answer: dict | None, timeout: int = 60, before_resume=None):
    name = f"approval-{uuid.uuid4().hex[:8]}"

    @flow(name=name, task_runner=runner(address, ledger_url, approval_policy=ask_for_training(timeout)))
    def gated():
        try:
            return finetune()
        except AdmissionDenied as exc:
            return f"denied: {exc}"

    result: list = []
    thread = threading.Thread(target=lambda: result.append(gated()))
    thread.start()
    if answer is not None:
        assert resume_when_paused(answer, flow_name=name, before=before_resume) is not None, \
            "the flow run never paused for approval"
    thread.join(timeout=120)
    assert not thread.is_alive()
    return result[0]


def test_paused_run_approved_through_the_api(gpu_cluster, sqlite_url):
    out = run_paused_flow(gpu_cluster.scheduler_address, sqlite_url,
                          {"approve": True, "approver": "alice", "reason": "nightly retrain"})
    assert out == "trained"
    ledger = Ledger(sqlite_url)
    kinds = [r.kind for r in ledger.records()]
    assert kinds == ["approval-requested", "approval", "admission", "settlement"]
    approval = ledger.records()[1]
    assert approval.payload["approver"] == "alice" and approval.payload["approved"] is True
    assert approval.payload["approval_rule"] == "training-needs-a-person"
    assert approval.payload["approver_chain"] == ["alice-approves"]
    assert ledger.verify().ok


def test_paused_run_rejected_through_the_api(gpu_cluster, sqlite_url):
    out = run_paused_flow(gpu_cluster.scheduler_address, sqlite_url,
                          {"approve": False, "approver": "bob", "reason": "too expensive"})
    assert out.startswith("denied: denied at approval: bob rejected the run: too expensive")
    ledger = Ledger(sqlite_url)
    assert [r.kind for r in ledger.records()] == ["approval-requested", "approval"]
    assert ledger.accounts()[0]["pending"] == 0 and ledger.accounts()[0]["posted"] == 0  # hold voided


def test_requester_cannot_approve_its_own_run(gpu_cluster, sqlite_url):
    out = run_paused_flow(gpu_cluster.scheduler_address, sqlite_url,
                          {"approve": True, "approver": "team-a/nightly", "reason": "me"})
    assert "cannot approve its own run" in out
    approval = [r for r in Ledger(sqlite_url).records() if r.kind == "approval"][-1].payload
    assert approval["approved"] is False and approval["approver"] == "team-a/nightly" and approval["outcome"] == "rejected"
    assert "admission" not in [r.kind for r in Ledger(sqlite_url).records()]


def test_silence_past_the_timeout_denies(gpu_cluster, sqlite_url):
    out = run_paused_flow(gpu_cluster.scheduler_address, sqlite_url, None, timeout=3)
    assert "denied at approval" in out and "silence denies" in out
    ledger = Ledger(sqlite_url)
    assert ledger.accounts()[0]["pending"] == 0
    assert [r.kind for r in ledger.records()] == ["approval-requested", "approval"]
    assert ledger.records()[-1].payload["approver"] == "timeout" and ledger.records()[-1].payload["approved"] is False


def test_policy_approver_decides_without_a_person(gpu_cluster, sqlite_url):
    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, approval_policy=ask_for_training(),
                             approver="policy"))
    def f():
        try:
            finetune()
        except AdmissionDenied as exc:
            return exc.stage
    assert f() == "approval"
    approval = Ledger(sqlite_url).records()[-1]
    assert approval.payload["channel"] == "policy" and approval.payload["approved"] is False


def test_only_holders_of_the_right_to_approve_may_approve(gpu_cluster, sqlite_url):
    out = run_paused_flow(gpu_cluster.scheduler_address, sqlite_url,
                          {"approve": True, "approver": "mallory", "reason": "trust me"})
    assert "'mallory' holds no grant with the right to approve this run" in out
    approval = [r for r in Ledger(sqlite_url).records() if r.kind == "approval"][-1]
    assert approval.payload["approved"] is False and approval.payload["approver"] == "mallory"


def test_a_run_waiting_for_approval_is_denied_if_its_grant_is_revoked_meanwhile(gpu_cluster, sqlite_url):
    from aisched_prefect.grants import revoke_grant

    ledger = Ledger(sqlite_url)
    out = run_paused_flow(gpu_cluster.scheduler_address, sqlite_url,
                          {"approve": True, "approver": "alice", "reason": "fine"},
                          before_resume=lambda: revoke_grant("team-a-root", by="security", reason="incident",
                                                             ledger=ledger))
    assert "denied at authority" in out and "'team-a-root' is revoked" in out
    kinds = [r.kind for r in ledger.records()]
    assert kinds[-2:] == ["settlement", "denial"] and "admission" not in kinds
    assert ledger.accounts()[0]["pending"] == 0


def test_two_identical_calls_of_one_flow_run_are_each_asked(gpu_cluster, sqlite_url):
    # Same task, same parameters, one after the other: the answer to the first must not answer the second.
    name = f"approval-twice-{uuid.uuid4().hex[:8]}"

    @flow(name=name, task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, approval_policy=ask_for_training(60)))
    def gated_twice():
        out = []
        for _ in range(2):
            try:
                out.append(finetune())
            except AdmissionDenied as exc:
                out.append(f"denied: {exc.reason}")
        return out

    result: list = []
    thread = threading.Thread(target=lambda: result.append(gated_twice()))
    thread.start()
    for answer in [{"approve": True, "approver": "alice", "reason": "first"},
                   {"approve": False, "approver": "alice", "reason": "not twice"}]:
        assert resume_when_paused(answer, flow_name=name) is not None, f"the flow run never paused for {answer['reason']!r}"
    thread.join(timeout=120)
    assert result == [["trained", "denied: alice rejected the run: not twice"]]
    records = Ledger(sqlite_url).records()
    digests = [r.payload["approval_digest"] for r in records if r.kind == "approval-requested"]
    assert len(digests) == 2 and digests[0] == digests[1]  # the same request, asked twice: two answers
