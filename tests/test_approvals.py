"""A real flow pauses for approval in Prefect; people answer at the control plane, and only answers it can
attribute to a registered approver other than the requester count."""

from __future__ import annotations

import time
import uuid

import pytest

from aisched_prefect import ai_task
from tests.approval_helpers import Gated, RawCall, accounts_of, api_answer, decision, outcome, page_answer
from tests.helpers import PRINCIPAL, ask_for_training, authority, tenant

pytestmark = pytest.mark.usefixtures("prefect_api")
TRAINING_RULE = "training-needs-a-person"


@ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=30)
def finetune():
    return "trained"


def gated(plane, timeout: int = 60, body=None, **kw):
    """A tenant whose training runs need a person, a flow run of it waiting in a thread, and its approvers."""
    t = tenant(plane, policy=ask_for_training(timeout), **kw)
    g = Gated(t, body or (lambda: outcome(finetune)))
    return t, g


def form_description(state) -> str:
    """What the Prefect UI shows above the pause's form."""
    from prefect.input.run_input import keyset_from_paused_state, read_flow_run_input

    return read_flow_run_input(keyset_from_paused_state(state)["description"], flow_run_id=state.state_details.flow_run_id)


def test_an_approver_answers_on_the_control_planes_page_and_the_run_completes(control_plane):
    t, g = gated(control_plane)
    alice = control_plane.approver("alice", t.authority)
    view = g.approval()
    assert view.status == "pending" and view.principal == PRINCIPAL and view.rule == TRAINING_RULE
    assert view.url == f"{control_plane.url}/approve/{view.id}"
    # The flow run shows as Paused in Prefect; the form's description says where the answer that counts is given.
    described = form_description(g.paused())
    assert "Approve AI task `finetune`?" in described and view.url in described
    assert "An answer typed into this Prefect form is not counted" in described
    visitor = control_plane.http.get(f"/approve/{view.id}")  # no link, no sign-in: nothing of the run, a sign-in
    assert visitor.status_code == 401 and "finetune" not in visitor.text and PRINCIPAL not in visitor.text
    page = control_plane.http.get(f"/approve/{view.id}", headers={"authorization": f"Bearer {alice}"}).text
    assert "Approve AI task finetune?" in page and PRINCIPAL in page and 'name="decision"' in page
    assert "Recorded: alice approved." in page_answer(control_plane, view.id, alice, reason="nightly retrain")
    assert g.outcome() == "trained"
    records = g.records()
    assert [r.kind for r in records] == ["approval-requested", "approval", "approval-consumed", "admission",
                                         "settlement"]
    d = decision(records)
    assert d["approver"] == "alice" and d["approved"] is True and d["verified"] is True
    assert d["channel"] == "credential" and d["reason"] == "nightly retrain"
    assert d["approval_rule"] == TRAINING_RULE and d["approver_chains"] == {"alice": ["alice-approves"]}
    assert records[3].payload["approval"] == "alice"
    assert control_plane.ledger().verify().ok
    after = control_plane.http.get(f"/approve/{view.id}", headers={"authorization": f"Bearer {alice}"}).text
    assert "consumed" in after and 'name="decision"' not in after  # decided: nothing left to answer


def test_a_rejection_on_the_page_denies_and_voids_the_hold(control_plane):
    t, g = gated(control_plane)
    bob = control_plane.approver("bob", t.authority)
    assert "Recorded: bob rejected." in page_answer(control_plane, g.approval().id, bob, approve=False,
                                                    reason="too expensive")
    out = g.outcome()
    assert out.startswith("denied: denied at approval: bob rejected the run: too expensive"), out
    assert g.kinds() == ["approval-requested", "approval", "settlement"]
    assert g.records()[-1].payload["outcome"] == "rejected"
    (account,) = accounts_of(control_plane, t)
    assert account["pending"] == 0 and account["posted"] == 0  # hold voided


def test_an_answer_typed_into_the_prefect_form_is_recorded_and_not_counted(control_plane):
    t, g = gated(control_plane)
    alice = control_plane.approver("alice", t.authority)
    view = g.approval()
    first = g.type_into_prefect_form({"approve": True, "approver": "alice", "reason": "typed in the UI"})
    # Still waiting: paused again under a new pause, the request still pending at the control plane.
    again = g.paused(other_than=first.state_details.pause_key)
    assert view.url in form_description(again)
    (unverified,) = [r for r in g.records() if r.kind == "approval-unverified"]
    assert unverified.payload["approval"] == view.id
    assert unverified.payload["said"] == {"approve": "True", "approver": "alice", "reason": "typed in the UI"}
    assert control_plane.ok("GET", f"/v1/approvals/{view.id}")["status"] == "pending"
    assert "approval" not in g.kinds()
    page_answer(control_plane, view.id, alice, reason="looked at it")
    assert g.outcome() == "trained"
    d = decision(g.records())
    assert d["channel"] == "credential" and d["reason"] == "looked at it"


def test_an_answer_typed_into_the_form_then_silence_denies_at_the_timeout(control_plane):
    t, g = gated(control_plane, timeout=15)  # room for the form's answer to be recorded first on a loaded machine
    g.approval()
    g.type_into_prefect_form({"approve": True, "approver": "bob", "reason": "trust me"})
    out = g.outcome()
    assert "denied at approval" in out and "silence denies" in out, out
    assert g.kinds() == ["approval-requested", "approval-unverified", "approval", "settlement"]
    assert decision(g.records())["approved"] is False and decision(g.records())["approver"] == "timeout"
    assert accounts_of(control_plane, t)[0]["pending"] == 0


def test_silence_past_the_timeout_denies_and_voids_the_hold(control_plane):
    t, g = gated(control_plane, timeout=3)
    t0 = time.monotonic()
    out = g.outcome()
    assert "denied at approval: no decision within 3s: silence denies" in out, out
    assert time.monotonic() - t0 < 30
    assert g.kinds() == ["approval-requested", "approval", "settlement"]
    d = decision(g.records())
    assert d["approver"] == "timeout" and d["approved"] is False
    assert g.records()[-1].payload["outcome"] == "approval-expired"
    assert accounts_of(control_plane, t)[0]["pending"] == 0


def test_the_requester_cannot_approve_its_own_run(control_plane):
    t, g = gated(control_plane)
    view = g.approval()
    # Its flow credential, through the API and on the page:
    resp = api_answer(control_plane, view.id, t.token, reason="me")
    assert resp.status_code == 403 and "a flow's credential cannot approve" in resp.json()["error"]
    assert "Not counted: a flow credential may not do this" in page_answer(control_plane, view.id, t.token)
    # An approver credential in the requester's own name:
    itself = control_plane.approver(PRINCIPAL, t.authority)
    resp = api_answer(control_plane, view.id, itself, reason="me")
    assert resp.status_code == 403 and "the requester cannot approve its own run" in resp.json()["error"]
    # A signature cannot stand in for a credential: nobody named in approver_keys, no key for the requester.
    resp = api_answer(control_plane, view.id, None, approver=PRINCIPAL, signature="00" * 64, signed_at=1.0)
    assert resp.status_code == 403
    assert control_plane.ok("GET", f"/v1/approvals/{view.id}")["status"] == "pending"
    page_answer(control_plane, view.id, control_plane.approver("bob", t.authority), approve=False, reason="no")
    assert "bob rejected the run" in g.outcome()
    assert [d.payload["approver"] for d in g.records() if d.kind == "approval"] == ["bob"]


def test_only_holders_of_the_right_to_approve_may_approve(control_plane):
    t, g = gated(control_plane)
    view = g.approval()
    mallory = control_plane.approver("mallory", t.authority)
    assert "Not counted: &#x27;mallory&#x27; holds no grant with the right to approve this run" in page_answer(
        control_plane, view.id, mallory, reason="trust me")
    # alice of another authority: her credential answers only runs under the authority it was issued for.
    other = tenant(control_plane)
    stranger = control_plane.approver("alice", other.authority)
    resp = api_answer(control_plane, view.id, stranger)
    assert resp.status_code == 403 and f"issued for authority {other.authority!r}" in resp.json()["error"]
    assert control_plane.ok("GET", f"/v1/approvals/{view.id}")["status"] == "pending"
    page_answer(control_plane, view.id, control_plane.approver("alice", t.authority), reason="fine")
    assert g.outcome() == "trained"
    assert [d.payload["approver"] for d in g.records() if d.kind == "approval"] == ["alice"]


def test_a_policy_approver_decides_without_a_person(control_plane):
    t = tenant(control_plane, policy=ask_for_training())
    g = Gated(t, lambda: outcome(finetune), approver="policy")
    out = g.outcome()
    assert out.startswith(f"denied: denied at approval: approval policy rule {TRAINING_RULE!r} asks a person"), out
    (denial,) = g.records()
    assert denial.kind == "denial" and denial.payload["stage"] == "approval"
    assert accounts_of(control_plane, t) == []  # nothing was held


def test_a_run_waiting_for_approval_is_denied_if_its_grant_is_revoked_meanwhile(control_plane):
    root = f"root-{uuid.uuid4().hex[:8]}"  # revocations are global: this test's own root
    t, g = gated(control_plane, authority_=authority(id=root))
    view = g.approval()
    assert control_plane.revoke(root, "incident").status_code == 200
    page_answer(control_plane, view.id, control_plane.approver("alice", t.authority), reason="fine")
    out = g.outcome()
    assert "denied at authority" in out and f"{root!r} is revoked" in out, out
    kinds = g.kinds()
    assert kinds[-2:] == ["settlement", "denial"] and "admission" not in kinds
    assert g.records()[-2].payload["outcome"] == "revoked-while-waiting"
    assert accounts_of(control_plane, t)[0]["pending"] == 0


def test_two_identical_calls_of_one_flow_run_are_each_asked(control_plane):
    # Same task, same parameters, one after the other: the answer to the first must not answer the second.
    t, g = gated(control_plane, body=lambda: [outcome(finetune) for _ in range(2)])
    alice = control_plane.approver("alice", t.authority)
    first = g.approval()
    page_answer(control_plane, first.id, alice, reason="first")
    second = g.approval()
    assert second.id != first.id and second.digest != first.digest  # each request signs its own digest
    page_answer(control_plane, second.id, alice, approve=False, reason="not twice")
    out = g.outcome()
    assert out[0] == "trained" and out[1].startswith("denied: denied at approval: alice rejected the run: not twice")
    asked = [r.payload for r in g.records() if r.kind == "approval-requested"]
    assert len(asked) == 2 and asked[0]["approval_digest"] == asked[1]["approval_digest"]  # the same call, twice


@ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=30)
def flaky_finetune():
    raise RuntimeError("diverged after doing its work")


def test_one_approval_allows_one_execution_even_when_it_fails(control_plane):
    # A call that fails after being approved does not leave its approval for the next identical call.
    def body():
        out = []
        for _ in range(2):
            try:
                flaky_finetune()
            except RuntimeError as exc:
                out.append(str(exc))
        return out

    t, g = gated(control_plane, body=body)
    alice = control_plane.approver("alice", t.authority)
    first = g.approval()
    page_answer(control_plane, first.id, alice)
    second = g.approval()  # asked again
    assert second.id != first.id
    page_answer(control_plane, second.id, alice)
    assert g.outcome() == ["diverged after doing its work"] * 2
    records = g.records()
    assert [r.payload["outcome"] for r in records if r.kind == "settlement"] == ["failed", "failed"]
    consumed = [r.payload["approval"] for r in records if r.kind == "approval-consumed"]
    assert consumed == [first.id, second.id]


def test_a_consumed_approval_is_refused_when_the_call_is_sent_again(control_plane):
    """What a flow could do by hand: send the approved call twice. The second is denied, and nothing runs."""
    t = tenant(control_plane, policy=ask_for_training())
    call = RawCall(t, finetune)
    try:
        reply, _ = call.send()
        assert reply.status == "approval-pending" and reply.approval is not None
        page_answer(control_plane, reply.approval.id, control_plane.approver("alice", t.authority))
        done, result = call.send(admission=reply.approval.id)
        assert done.status == "completed" and result == "trained"
        # The same call sent again (its reply lost on the way): the reply on file, with its small result sealed
        # beside it, never a second run (one settlement, below).
        resent, again = call.send(admission=reply.approval.id)
        assert resent.status == "completed" and again == "trained" and resent.key == done.key
        replay, out = call.send(admission=reply.approval.id, rerun=True)  # another call, the same approval
        assert replay.status == "denied", replay
        assert "already allowed one execution" in replay.reason and out == b""
    finally:
        call.close()
    settled = [r.payload["outcome"] for r in control_plane.records(call.flow_run_id) if r.kind == "settlement"]
    assert settled == ["completed"]


def test_holds_of_a_request_waiting_for_a_person_are_kept_until_its_deadline_then_released(sqlite_url):
    """A hold's lease runs out when nobody renews it, and a run-out hold is charged in full. A request waiting
    for a person ran nothing: the control plane renews its holds while it waits and releases them at its
    deadline, also when the flow process that asked is gone."""
    from aisched_prefect.control.admission.record import Admission
    from aisched_prefect.control.approvals.requests import ApprovalBook
    from aisched_prefect.control.authority.state import AuthorityState
    from aisched_prefect.ledger import Ledger
    from aisched_prefect.request import AIRequest
    from blocks import BudgetLine, RunFacts

    ledger = Ledger(sqlite_url, lease_seconds=1)
    book = ApprovalBook(ledger, AuthorityState(ledger), "http://cp")
    ids = {"flow_run_id": "fr", "task_run_id": "tr", "principal": PRINCIPAL}
    held, record = ledger.reserve([BudgetLine(budget="team", period="p", limit=10, amount=4)],
                                  kind="approval-requested", payload={"task": "finetune"}, **ids)
    request = AIRequest.build(kind="training", gpus=1, est_seconds=30)
    admission = Admission(id=str(record.seq), credential="c", principal=PRINCIPAL, tenant="team-a", flow_run_id="fr",
                          task_run_id="tr", task_name="finetune", flow_name="f", run_key="fr/finetune", request=request,
                          workers=[], holds=held, reserved=4.0, priced_type="H100", chain=["team-a-root"],
                          expires_at=None, facts=RunFacts(principal=PRINCIPAL, kind="training"), payload_digest="p" * 64,
                          code_digest="c" * 64, approval=str(record.seq), approval_digest="d" * 64)
    view = book.create(admission, {"approval_digest": "d" * 64, "timeout_seconds": 3, "approval_rule": "r"}, "USD")
    assert f"[http://cp/approve/{view.id}](http://cp/approve/{view.id})" in view.describe
    for _ in range(4):  # past the hold's 1 s lease, tended as the watcher does
        time.sleep(0.5)
        book.tend()
    assert ledger.expire_holds() == []  # still leased: a sweep charges nothing for a run that waits
    (account,) = ledger.accounts()
    assert account["posted"] == 0 and account["pending"] == 4
    time.sleep(max(0.0, view.deadline - time.time()) + 0.1)
    book.tend()  # nobody asks any more: the deadline ends it
    assert book.view(view.id).status == "expired"
    (account,) = ledger.accounts()
    assert account["posted"] == 0 and account["pending"] == 0
    last = [r for r in ledger.records("fr") if r.kind in ("approval", "settlement")]
    assert [r.kind for r in last][-2:] == ["approval", "settlement"] and last[-1].payload["outcome"] == "approval-expired"
