"""Approvals people can trust: signed answers bound to one request, quorum, per-rule timeouts, hooks, events,
the CLI, new code versions, and the suspended request of a deployment run."""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import datetime, timezone

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prefect import flow
from typer.testing import CliRunner

from aisched_prefect import ai_task
from aisched_prefect.approvals import public_key_hex
from aisched_prefect.cli import app
from blocks import ApprovalPolicyBlock, ApprovalRule
from tests.approval_helpers import Gated, RawCall, accounts_of, api_answer, decision, outcome, page_answer, signed
from tests.helpers import PRINCIPAL, authority, tenant

pytestmark = pytest.mark.usefixtures("prefect_api")
cli = CliRunner()
ALICE, BOB = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
RULE = "training-needs-a-person"


@ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=30)
def finetune(lr: float = 0.1):
    return f"trained at {lr}"


def policy(**rule) -> ApprovalPolicyBlock:
    return ApprovalPolicyBlock(rules=[ApprovalRule(name=RULE, kinds=["training"], **rule)], timeout_seconds=60)


def keyed_authority(**keys):
    return authority().model_copy(update={"approver_keys": {name: public_key_hex(k) for name, k in keys.items()}})


def gated(plane, *, approval_policy=None, auth=None, body=None, lr=0.1, **runner):
    t = tenant(plane, policy=approval_policy or policy(), authority_=auth)
    return t, Gated(t, body or (lambda: outcome(lambda: finetune(lr))), **runner)


def keyfile(tmp_path, key) -> str:
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    path = tmp_path / f"{uuid.uuid4().hex[:6]}.key"
    path.write_bytes(key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    return str(path)


def tokenfile(tmp_path, token: str) -> str:
    path = tmp_path / f"{uuid.uuid4().hex[:6]}.token"
    path.write_text(token)
    return str(path)


def aisched(*args: str) -> str:
    out = cli.invoke(app, list(args))
    assert out.exit_code == 0, out.output
    return out.output


def test_a_signed_cli_approval_counts_and_is_recorded_as_verified(control_plane, tmp_path, monkeypatch):
    monkeypatch.delenv("AISCHED_OPERATOR_TOKEN", raising=False)
    monkeypatch.delenv("AISCHED_TOKEN", raising=False)
    monkeypatch.setenv("AISCHED_HOME", str(tmp_path))  # no token at hand: the signature alone proves who answers
    t, g = gated(control_plane, auth=keyed_authority(alice=ALICE))
    view = g.approval()
    said = aisched("approve", view.id, "--as", "alice", "--key", keyfile(tmp_path, ALICE), "--reason", "looked at it",
                   "--control-plane", control_plane.url)
    assert "status approved" in said
    assert g.outcome() == "trained at 0.1"
    d = decision(g.records())
    assert d["approver"] == "alice" and d["verified"] is True and d["channel"] == "signed"
    assert d["approver_chains"] == {"alice": ["alice-approves"]} and d["reason"] == "looked at it"
    assert d["request_digest"] == view.digest


def test_an_answer_naming_a_key_holder_without_signature_or_credential_is_refused(control_plane):
    t, g = gated(control_plane, auth=keyed_authority(alice=ALICE))
    view = g.approval()
    resp = api_answer(control_plane, view.id, None, approver="alice", reason="it's me, honest")
    assert resp.status_code == 403 and "needs an approver's credential or signature" in resp.json()["error"]
    resp = api_answer(control_plane, view.id, None, **signed(BOB, view, "alice"))  # signed, by the wrong key
    assert resp.status_code == 403 and "does not match this request" in resp.json()["error"]
    assert control_plane.ok("GET", f"/v1/approvals/{view.id}")["status"] == "pending"
    page_answer(control_plane, view.id, control_plane.approver("bob", t.authority), approve=False, reason="no")
    assert "bob rejected the run: no" in g.outcome()
    assert accounts_of(control_plane, t)[0]["pending"] == 0


def test_a_signed_approval_replayed_onto_another_request_is_refused(control_plane):
    def body():  # the same call twice, then with changed parameters
        return [outcome(lambda: finetune(0.1)), outcome(lambda: finetune(0.1)), outcome(lambda: finetune(0.9))]

    t, g = gated(control_plane, auth=keyed_authority(alice=ALICE), body=body)
    first = g.approval()
    kept = signed(ALICE, first, "alice", reason="ok")
    assert api_answer(control_plane, first.id, None, **kept).status_code == 200
    second = g.approval()  # identical to the first: same call digest, its own request digest
    for target in (second,):
        resp = api_answer(control_plane, target.id, None, **kept)
        assert resp.status_code == 403, resp.text
        assert "the signature of 'alice' does not match this request" in resp.json()["error"]
    assert api_answer(control_plane, first.id, None, **kept).status_code == 409  # used: already decided
    assert api_answer(control_plane, second.id, None, **signed(ALICE, second, "alice")).status_code == 200
    third = g.approval()
    resp = api_answer(control_plane, third.id, None, **kept)
    assert resp.status_code == 403 and "does not match this request" in resp.json()["error"]
    page_answer(control_plane, third.id, control_plane.approver("bob", t.authority), approve=False, reason="enough")
    out = g.outcome()
    assert out[:2] == ["trained at 0.1", "trained at 0.1"] and "bob rejected the run: enough" in out[2]
    asked = [r.payload for r in g.records() if r.kind == "approval-requested"]
    assert asked[0]["approval_digest"] == asked[1]["approval_digest"] != asked[2]["approval_digest"]


def test_k_of_n_needs_that_many_different_approvers(control_plane):
    t, g = gated(control_plane, approval_policy=policy(approvals_required=2))
    alice, bob = (control_plane.approver(n, t.authority) for n in ("alice", "bob"))
    view = g.approval()
    assert "approvals needed: 2 different approvers" in view.describe
    for who in (alice, alice):  # alice twice counts once
        assert api_answer(control_plane, view.id, who, reason="alice says so").json()["status"] == "pending"
    assert api_answer(control_plane, view.id, bob, reason="bob says so").json()["status"] == "approved"
    assert g.outcome() == "trained at 0.1"
    records = g.records()
    votes = [(r.payload["approver"], r.payload["counted"]) for r in records if r.kind == "approval-vote"]
    assert votes == [("alice", True), ("alice", False)]
    d = decision(records)
    assert d["approved_by"] == ["alice", "bob"]
    assert d["approver_chains"] == {"alice": ["alice-approves"], "bob": ["bob-approves"]}


def test_one_rejection_ends_a_quorum(control_plane):
    t, g = gated(control_plane, approval_policy=policy(approvals_required=2))
    view = g.approval()
    api_answer(control_plane, view.id, control_plane.approver("alice", t.authority))
    assert api_answer(control_plane, view.id, control_plane.approver("bob", t.authority), approve=False,
                      reason="no").json()["status"] == "rejected"
    assert g.outcome().startswith("denied: denied at approval: bob rejected the run: no")
    assert accounts_of(control_plane, t)[0]["pending"] == 0


def test_a_rule_can_count_only_signed_approvals(control_plane):
    t, g = gated(control_plane, approval_policy=policy(require_signature=True), auth=keyed_authority(alice=ALICE))
    view = g.approval()
    assert view.require_signature
    resp = api_answer(control_plane, view.id, control_plane.approver("bob", t.authority))
    assert resp.status_code == 403 and f"rule {RULE!r} counts only signed approvals" in resp.json()["error"]
    resp = api_answer(control_plane, view.id, None, **signed(BOB, view, "bob"))
    assert resp.status_code == 403 and "'bob' signed, but has no key" in resp.json()["error"]
    assert api_answer(control_plane, view.id, None, **signed(ALICE, view, "alice")).json()["status"] == "approved"
    assert g.outcome() == "trained at 0.1"
    assert decision(g.records())["channel"] == "signed"


def test_a_rule_timeout_denies_with_a_clear_message(control_plane):
    t, g = gated(control_plane, approval_policy=policy(timeout_seconds=3))
    t0 = time.monotonic()
    out = g.outcome()
    assert "denied at approval: no decision within 3s: silence denies" in out and time.monotonic() - t0 < 40
    assert accounts_of(control_plane, t)[0]["pending"] == 0


def test_cli_reject_the_hook_and_events(control_plane, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter

    asked = []
    t, g = gated(control_plane, approval_hook=asked.append)
    view = g.approval()
    bob = tokenfile(tmp_path, control_plane.approver("bob", t.authority))
    said = aisched("reject", view.id, "--reason", "looked at it", "--control-plane", control_plane.url,
                   "--token-file", bob)
    assert f"rejected {view.id}: the run will not start and its hold is released" in said
    assert g.outcome().startswith("denied: denied at approval: bob rejected the run: looked at it")
    assert len(asked) == 1 and asked[0].id == view.id and asked[0].rule == RULE and len(asked[0].digest) == 64
    assert asked[0].url == view.url
    names: set[str] = set()
    for _ in range(50):
        with get_client(sync_client=True) as client:
            page = client.read_events(EventFilter(event=EventNameFilter(prefix=["aisched.approval."])), limit=50)
        names = {e.event for e in page.events if e.resource.id == f"aisched.approval.{view.id}"}
        if len(names) == 2:
            break
        time.sleep(0.2)
    assert names == {"aisched.approval.requested", "aisched.approval.decided"}
    bad = cli.invoke(app, ["approve", "999999999", "--control-plane", control_plane.url, "--token-file", bob])
    assert bad.exit_code != 0 and "no approval '999999999'" in str(bad.exception)  # `aisched` prints it in one line


def test_the_approval_hook_can_be_a_webhook(control_plane):
    from http.server import BaseHTTPRequestHandler, HTTPServer

    received: list[dict] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        t, g = gated(control_plane, approval_hook=f"http://127.0.0.1:{server.server_port}/approvals")
        view = g.approval()
        page_answer(control_plane, view.id, control_plane.approver("bob", t.authority), approve=False)
        out = g.outcome()
    finally:
        server.shutdown()
    assert out.startswith("denied: denied at approval: bob rejected the run")
    assert len(received) == 1 and received[0]["event"] == "aisched.approval.requested"
    assert received[0]["task_name"] == "finetune" and received[0]["principal"] == PRINCIPAL
    assert received[0]["url"] == view.url


@pytest.mark.parametrize("hour, matches", [(20, True), (3, True), (8, False), (12, False)])
def test_hours_utc_wrap_around_midnight(hour, matches):
    from blocks import RunFacts

    rule = ApprovalRule(name="night", hours_utc="18-8")
    facts = RunFacts(principal="p", kind="training")
    assert rule.matches(facts, datetime(2026, 11, 29, hour, tzinfo=timezone.utc)) is matches


def test_bad_hours_name_the_field():
    with pytest.raises(ValueError, match=r"hours_utc='25-3': write 'FROM-TO' in whole UTC hours"):
        ApprovalRule(name="x", hours_utc="25-3")


@ai_task(name="finetune", gpus=1, gpu_type="H100", kind="training", est_seconds=30)
def finetune_changed(lr: float = 0.1):
    return f"trained differently at {lr}"


def test_the_first_run_of_new_code_asks_and_later_runs_do_not(control_plane):
    t = tenant(control_plane, policy=ApprovalPolicyBlock(rules=[ApprovalRule(name="new-code", new_flow_version=True)]))
    alice = control_plane.approver("alice", t.authority)
    name = f"versioned-{uuid.uuid4().hex[:8]}"
    asked = []
    for task, expect in ((finetune, "trained at 0.1"), (finetune, "trained at 0.1"),
                         (finetune_changed, "trained differently at 0.1")):
        # The declared flow version never changes: the code is what the rule keys on.
        g = Gated(t, lambda: task(), name=name, version="1")
        while g.thread.is_alive():
            try:
                view = g.approval(timeout=0.5)
            except AssertionError:
                continue
            asked.append(view.rule)
            page_answer(control_plane, view.id, alice)
        assert g.outcome() == expect
    assert asked == ["new-code", "new-code"]  # the first run of each code, not the second run of the same code


def test_a_suspended_request_is_one_entry_across_re_runs_and_leaves_the_list_at_its_deadline(control_plane):
    """A deployment run suspends while it waits (its holds released) and re-runs from the start once answered:
    the re-run's call finds the same request, and the answer allows its one execution with a fresh hold."""
    t = tenant(control_plane, policy=policy())
    call = RawCall(t, finetune, 0.1)
    try:
        reply, _ = call.send()
        first = reply.approval
        assert control_plane.ok("POST", f"/v1/approvals/{first.id}/suspend", t.token)["status"] == "suspended"
        assert accounts_of(control_plane, t)[0]["pending"] == 0  # a suspended run holds no budget
        reply, _ = call.send(rerun=True)  # the re-run before anyone answered: still the one request
        assert reply.status == "approval-pending" and reply.approval.id == first.id
        listed = [v for v in control_plane.ok("GET", "/v1/approvals") if v["flow_run_id"] == call.flow_run_id]
        assert [(v["id"], v["status"]) for v in listed] == [(first.id, "suspended")]
        page_answer(control_plane, first.id, control_plane.approver("alice", t.authority))
        reply, _ = call.send(rerun=True)  # the re-run after the answer
        assert reply.approval.id == first.id and reply.approval.status == "approved"
        done, result = call.send(admission=first.id)
        assert done.status == "completed" and result == "trained at 0.1"
    finally:
        call.close()
    kinds = [r.kind for r in control_plane.records(call.flow_run_id)]
    assert kinds.count("approval-suspended") == 1 and kinds.count("approval") == 1 and kinds[-1] == "settlement"
    (account,) = accounts_of(control_plane, t)
    assert account["pending"] == 0 and account["posted"] > 0

    # Unanswered past its deadline: no longer listed, and its re-run is denied (Prefect would refuse to resume it).
    late = tenant(control_plane, policy=policy(timeout_seconds=2))
    call = RawCall(late, finetune, 0.2)
    try:
        reply, _ = call.send()
        control_plane.ok("POST", f"/v1/approvals/{reply.approval.id}/suspend", late.token)
        time.sleep(2.5)
        assert not [v for v in control_plane.ok("GET", "/v1/approvals") if v["flow_run_id"] == call.flow_run_id]
        again, _ = call.send(rerun=True)
        denied, _ = call.send(admission=again.approval.id)
        assert denied.status == "denied" and "no decision within 2s: silence denies" in denied.reason
    finally:
        call.close()
    assert accounts_of(control_plane, late)[0]["pending"] == 0


def mapped(lrs):
    """Calls submitted one by one, each asking on its own (a `.map()` asks once for all its shards:
    tests/test_map_array.py); one answer can cover them together."""
    return lambda: [outcome(f.result) for f in [finetune.submit(lr) for lr in lrs]]


def test_a_map_asks_once_for_the_batch_and_records_a_decision_per_item(control_plane):
    t, g = gated(control_plane, body=mapped([0.1, 0.2, 0.3]))
    views = g.waiting(3)
    g.paused()
    first, others = views[0], [v.id for v in views[1:]]
    alice = control_plane.approver("alice", t.authority)
    page = control_plane.http.get(f"/approve/{first.id}", headers={"authorization": f"Bearer {alice}"}).text
    assert "Also waiting in this flow run" in page and all(f'value="{i}" checked' in page for i in others)
    said = page_answer(control_plane, first.id, alice, items=tuple(others))
    assert "Recorded: alice approved 3 runs." in said
    assert g.outcome() == ["trained at 0.1", "trained at 0.2", "trained at 0.3"]
    assert g.pauses() == 1  # one pause, one answer
    approvals = [r for r in g.records() if r.kind == "approval"]
    assert len(approvals) == 3 and len({r.task_run_id for r in approvals}) == 3
    assert all(sorted(r.payload["batch"]) == sorted(v.id for v in views) for r in approvals)
    assert len({r.payload["batch_digest"] for r in approvals}) == 1
    assert {r.payload["batch_digest"] for r in approvals}.isdisjoint(r.payload["request_digest"] for r in approvals)


def test_a_rejected_batch_denies_every_item_and_releases_every_hold(control_plane):
    t, g = gated(control_plane, body=mapped([0.1, 0.2]))
    views = g.waiting(2)
    resp = api_answer(control_plane, views[0].id, control_plane.approver("bob", t.authority), approve=False,
                      reason="looked at it", items=[views[1].id])
    assert resp.status_code == 200, resp.text
    out = g.outcome()
    assert len(out) == 2 and all("bob rejected the run: looked at it" in o for o in out)
    (account,) = accounts_of(control_plane, t)
    assert account["pending"] == 0 and account["posted"] == 0


def test_a_signed_approval_covers_a_whole_batch_and_only_it(control_plane):
    from aisched_prefect.approvals import batch_digest, sign_approval

    t, g = gated(control_plane, auth=keyed_authority(alice=ALICE), body=mapped([0.1, 0.2]))
    views = g.waiting(2)
    at = time.time()
    body = {"approve": True, "approver": "alice", "reason": "both", "signed_at": at,
            "signature": sign_approval(ALICE, batch_digest([v.digest for v in views]), True, "alice", "both", at)}
    # The batch's signature does not answer one item alone, and an item outside the batch is refused whole.
    assert api_answer(control_plane, views[0].id, None, **body).status_code == 403
    resp = api_answer(control_plane, views[0].id, None, items=[views[1].id, "999999999"], **body)
    assert resp.status_code == 404 and all(
        control_plane.ok("GET", f"/v1/approvals/{v.id}")["status"] == "pending" for v in views)
    assert api_answer(control_plane, views[0].id, None, items=[views[1].id], **body).status_code == 200
    assert g.outcome() == ["trained at 0.1", "trained at 0.2"]
    approvals = [r.payload for r in g.records() if r.kind == "approval"]
    assert len(approvals) == 2 and all(a["verified"] and a["channel"] == "signed" for a in approvals)
