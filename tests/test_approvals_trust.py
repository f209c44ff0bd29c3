"""Approvals people can trust: signed answers, binding to the request, quorum, per-rule timeouts, events, CLI."""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import datetime, timezone

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from prefect.flow_runs import resume_flow_run
from typer.testing import CliRunner

from aisched_prefect import AdmissionDenied, Ledger, ai_task
from aisched_prefect.approvals import public_key_hex
from aisched_prefect.cli import app
from blocks import ApprovalPolicyBlock, ApprovalRule
from tests.helpers import authority, runner

pytestmark = pytest.mark.usefixtures("prefect_api")
cli = CliRunner()
ALICE, BOB = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()


@ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=30)
def finetune(lr: float = 0.1):
    return f"trained at {lr}"


def policy(**rule) -> ApprovalPolicyBlock:
    return ApprovalPolicyBlock(rules=[ApprovalRule(name="training-needs-a-person", kinds=["training"], **rule)],
                               timeout_seconds=60)


def keyed_authority(**keys):
    return authority().model_copy(update={"approver_keys": {name: public_key_hex(k) for name, k in keys.items()}})


def outcome(future):
    try:
        return future.result()
    except AdmissionDenied as exc:
        return f"denied: {exc}"


def run_gated(address, ledger_url, respond, *, approval_policy=None, auth=None, lr=0.1, mapped=None, **kw):
    """Run a flow whose training task needs approval; call respond(flow_run_id, answer_number) at each pause."""
    name = f"gated-{uuid.uuid4().hex[:8]}"

    @flow(name=name, task_runner=runner(address, ledger_url, approval_policy=approval_policy or policy(),
                                        authority=auth or authority(), **kw))
    def gated():
        if mapped is not None:
            return [outcome(f) for f in finetune.map(mapped)]
        try:
            return finetune(lr)
        except AdmissionDenied as exc:
            return f"denied: {exc}"

    result: list = []
    thread = threading.Thread(target=lambda: result.append(gated()))
    thread.start()
    seen: set = set()
    deadline = time.time() + 120
    with get_client(sync_client=True) as client:
        while thread.is_alive() and time.time() < deadline:
            runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[name])))
            state = runs[0].state if runs else None
            if state is not None and state.is_paused() and state.id not in seen and respond is not None:
                seen.add(state.id)
                for _ in range(50):  # the input schema is saved just after the Paused state
                    try:
                        respond(runs[0].id, len(seen))
                        break
                    except Exception:
                        time.sleep(0.2)
            time.sleep(0.2)
    thread.join(timeout=60)
    assert not thread.is_alive()
    return result[0]


def api_answer(approver: str, approve: bool = True, **extra):
    return lambda flow_run_id, _: resume_flow_run(flow_run_id, run_input={
        "approve": approve, "approver": approver, "reason": f"{approver} says so", **extra})


def cli_answer(ledger_url: str, approver: str, key_path: str | None, verb: str = "approve"):
    def respond(flow_run_id, _):
        listed = cli.invoke(app, ["approvals", "list", "--json", "--ledger", ledger_url])
        (waiting,) = [json.loads(line) for line in listed.stdout.splitlines()]
        args = [verb, waiting["task_run_id"][:8], "--as", approver, "--reason", "looked at it", "--ledger", ledger_url]
        out = cli.invoke(app, args + (["--key", key_path] if key_path else []))
        assert out.exit_code == 0, out.stdout
    return respond


def decision(ledger_url: str):
    return [r for r in Ledger(ledger_url).records() if r.kind == "approval"][-1].payload


def keyfile(tmp_path, key) -> str:
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    path = tmp_path / f"{uuid.uuid4().hex[:6]}.key"
    path.write_bytes(key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    return str(path)


def test_a_signed_cli_approval_counts_and_is_recorded_as_verified(gpu_cluster, sqlite_url, tmp_path):
    out = run_gated(gpu_cluster.scheduler_address, sqlite_url, cli_answer(sqlite_url, "alice", keyfile(tmp_path, ALICE)),
                    auth=keyed_authority(alice=ALICE))
    assert out == "trained at 0.1"
    d = decision(sqlite_url)
    assert d["approver"] == "alice" and d["verified"] is True and d["channel"] == "signed"
    assert d["approver_chains"] == {"alice": ["alice-approves"]}


def test_an_unsigned_answer_in_the_name_of_a_key_holder_is_a_rejection(gpu_cluster, sqlite_url):
    out = run_gated(gpu_cluster.scheduler_address, sqlite_url, api_answer("alice"), auth=keyed_authority(alice=ALICE))
    assert "an unsigned answer in the name of 'alice', who has a key" in out
    assert decision(sqlite_url)["approved"] is False and Ledger(sqlite_url).accounts()[0]["pending"] == 0


def test_a_signed_approval_replayed_onto_another_request_is_refused(gpu_cluster, sqlite_url):
    sent: list[dict] = []

    def sign_and_keep(flow_run_id, _):
        from aisched_prefect.approval_channel import answer

        sent.append(answer(Ledger(sqlite_url), "", approve=True, approver="alice", reason="ok", key=ALICE))

    auth = keyed_authority(alice=ALICE)
    assert run_gated(gpu_cluster.scheduler_address, sqlite_url, sign_and_keep, auth=auth) == "trained at 0.1"
    replay = lambda flow_run_id, _: resume_flow_run(flow_run_id, run_input=sent[0])  # noqa: E731
    out = run_gated(gpu_cluster.scheduler_address, sqlite_url, replay, auth=auth, lr=0.9)  # changed parameters
    assert "the signature of 'alice' does not match this request" in out


def test_k_of_n_needs_that_many_different_approvers(gpu_cluster, sqlite_url):
    answers = {1: "alice", 2: "alice", 3: "bob"}  # alice twice counts once
    out = run_gated(gpu_cluster.scheduler_address, sqlite_url,
                    lambda frid, n: api_answer(answers[n])(frid, n), approval_policy=policy(approvals_required=2))
    assert out == "trained at 0.1"
    records = Ledger(sqlite_url).records()
    votes = [(r.payload["approver"], r.payload["counted"]) for r in records if r.kind == "approval-vote"]
    assert votes == [("alice", True), ("alice", False)]
    assert decision(sqlite_url)["approved_by"] == ["alice", "bob"]


def test_one_rejection_ends_a_quorum(gpu_cluster, sqlite_url):
    answers = {1: ("alice", True), 2: ("bob", False)}
    out = run_gated(gpu_cluster.scheduler_address, sqlite_url,
                    lambda frid, n: api_answer(answers[n][0], answers[n][1])(frid, n),
                    approval_policy=policy(approvals_required=2))
    assert out.startswith("denied: denied at approval: bob rejected the run")


def test_a_rule_can_count_only_signed_approvals(gpu_cluster, sqlite_url):
    out = run_gated(gpu_cluster.scheduler_address, sqlite_url, api_answer("bob"),
                    approval_policy=policy(require_signature=True))
    assert "rule 'training-needs-a-person' counts only signed approvals, and 'bob' has no key" in out


def test_a_rule_timeout_denies_with_a_clear_message(gpu_cluster, sqlite_url):
    t0 = time.monotonic()
    out = run_gated(gpu_cluster.scheduler_address, sqlite_url, None, approval_policy=policy(timeout_seconds=3))
    assert "no decision within 3s: silence denies" in out and time.monotonic() - t0 < 40
    assert Ledger(sqlite_url).accounts()[0]["pending"] == 0


def test_cli_reject_and_the_hook_and_events(gpu_cluster, sqlite_url):
    asked = []
    out = run_gated(gpu_cluster.scheduler_address, sqlite_url, cli_answer(sqlite_url, "bob", None, verb="reject"),
                    approval_hook=asked.append)
    assert out.startswith("denied: denied at approval: bob rejected the run: looked at it")
    assert len(asked) == 1 and asked[0].rule == "training-needs-a-person" and len(asked[0].digest) == 64
    from prefect.events.filters import EventFilter, EventNameFilter

    names: set[str] = set()
    for _ in range(50):
        with get_client(sync_client=True) as client:
            page = client.read_events(EventFilter(event=EventNameFilter(prefix=["aisched.approval."])), limit=50)
        names = {e.event for e in page.events if e.resource.id == f"aisched.approval.{asked[0].task_run_id}"}
        if len(names) == 2:
            break
        time.sleep(0.2)
    assert names == {"aisched.approval.requested", "aisched.approval.decided"}
    assert "no run waiting for approval matches" in cli.invoke(
        app, ["approve", "nope", "--as", "bob", "--ledger", sqlite_url]).stdout


def test_a_map_asks_once_for_the_batch_and_records_a_decision_per_item(gpu_cluster, sqlite_url):
    pauses = []

    def respond(flow_run_id, n):
        pauses.append(n)
        api_answer("alice")(flow_run_id, n)

    out = run_gated(gpu_cluster.scheduler_address, sqlite_url, respond, mapped=[0.1, 0.2, 0.3])
    assert out == ["trained at 0.1", "trained at 0.2", "trained at 0.3"] and pauses == [1]
    approvals = [r for r in Ledger(sqlite_url).records() if r.kind == "approval"]
    assert len(approvals) == 3 and len({r.task_run_id for r in approvals}) == 3
    assert all(sorted(r.payload["batch"]) == sorted(a.task_run_id for a in approvals) for r in approvals)
    assert {r.payload["batch_digest"] for r in approvals} != {r.payload["approval_digest"] for r in approvals}


def test_a_rejected_batch_denies_every_item_and_releases_every_hold(gpu_cluster, sqlite_url, tmp_path):
    out = run_gated(gpu_cluster.scheduler_address, sqlite_url, cli_answer(sqlite_url, "bob", None, verb="reject"),
                    mapped=[0.1, 0.2])
    assert len(out) == 2 and all("bob rejected the run: looked at it" in o for o in out)
    ledger = Ledger(sqlite_url)
    assert ledger.accounts()[0]["pending"] == 0 and ledger.accounts()[0]["posted"] == 0


def test_a_signed_cli_approval_covers_a_whole_batch(gpu_cluster, sqlite_url, tmp_path):
    out = run_gated(gpu_cluster.scheduler_address, sqlite_url, cli_answer(sqlite_url, "alice", keyfile(tmp_path, ALICE)),
                    auth=keyed_authority(alice=ALICE), mapped=[0.1, 0.2])
    assert out == ["trained at 0.1", "trained at 0.2"]
    assert all(r.payload["verified"] for r in Ledger(sqlite_url).records() if r.kind == "approval")


@pytest.mark.parametrize("hour, matches", [(20, True), (3, True), (8, False), (12, False)])
def test_hours_utc_wrap_around_midnight(hour, matches):
    from blocks import RunFacts

    rule = ApprovalRule(name="night", hours_utc="18-8")
    facts = RunFacts(principal="p", kind="training")
    assert rule.matches(facts, datetime(2026, 11, 29, hour, tzinfo=timezone.utc)) is matches


def test_bad_hours_name_the_field():
    with pytest.raises(ValueError, match=r"hours_utc='25-3': write 'FROM-TO' in whole UTC hours"):
        ApprovalRule(name="x", hours_utc="25-3")


def test_the_first_run_of_a_new_flow_version_asks_and_later_runs_do_not(gpu_cluster, sqlite_url):
    from aisched_prefect import PolicyApprover

    rules = ApprovalPolicyBlock(rules=[ApprovalRule(name="new-version", new_flow_version=True)])

    def make(version):
        @flow(name="versioned-train", version=version, task_runner=runner(
            gpu_cluster.scheduler_address, sqlite_url, approval_policy=rules, approver=PolicyApprover(on_ask="approve")))
        def versioned():
            return finetune()
        return versioned

    for version in ("v1", "v1", "v2"):
        assert make(version)() == "trained at 0.1"
    rules_applied = [r.payload["approval_rule"] for r in Ledger(sqlite_url).records() if r.kind == "admission"]
    assert rules_applied == ["new-version", None, "new-version"]


def test_the_approval_hook_can_be_a_webhook(gpu_cluster, sqlite_url):
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
        out = run_gated(gpu_cluster.scheduler_address, sqlite_url, api_answer("bob", approve=False),
                        approval_hook=f"http://127.0.0.1:{server.server_port}/approvals")
    finally:
        server.shutdown()
    assert out.startswith("denied: denied at approval: bob rejected the run")
    assert len(received) == 1 and received[0]["event"] == "aisched.approval.requested"
    assert received[0]["task_name"] == "finetune" and received[0]["principal"] == "team-a/nightly"


def test_a_suspended_request_is_one_entry_across_re_runs_and_leaves_the_list_at_its_deadline(sqlite_url):
    from aisched_prefect.approval_channel import pending

    ledger = Ledger(sqlite_url)
    asked = {"task": "promote", "approval_digest": "d" * 64, "approval_rule": "r", "estimate": {"amount": 1.0}}
    ledger.record("approval-requested", asked, flow_run_id="fr", task_run_id="first", principal="p")
    ledger.record("approval-suspended", {**asked, "expires_at": 1_000.0}, flow_run_id="fr", task_run_id="first")
    assert [a.task_run_id for a in pending(ledger, now=999.0)] == ["first"]
    assert pending(ledger, now=1_001.0) == []  # Prefect refuses to resume it now: nothing waits
    # Resumed in time: the re-run asks again under a new task run id, with the same digest: still one entry,
    # ended by the decision recorded for the re-run.
    ledger.record("approval-requested", asked, flow_run_id="fr", task_run_id="second", principal="p")
    assert [a.task_run_id for a in pending(ledger, now=999.0)] == ["first"]
    ledger.record("approval", {**asked, "approved": True, "approver": "alice"}, flow_run_id="fr", task_run_id="second")
    assert pending(ledger, now=999.0) == []
