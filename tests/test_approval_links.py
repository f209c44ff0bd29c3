"""Approvers answer without pasting a secret: a one-time link per approver and request, delivered by the policy's
approval hook from the control plane (never to the flow process, which is the requester); or a sign-in on the page.
`aisched approvals list` ids are short, and approve/reject take them."""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer
from urllib.parse import urlencode, urlsplit

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from aisched_prefect import ai_task
from aisched_prefect.cli import app
from blocks import ApprovalPolicyBlock, ApprovalRule
from tests.approval_helpers import RawCall, decision
from tests.helpers import tenant

needs_prefect = pytest.mark.usefixtures("prefect_api")


@ai_task(gpus=1, gpu_type="H100", kind="training", model="llama-8b", est_seconds=1800)
def finetune(lr: float = 0.1, steps: int = 100) -> str:
    return f"trained at {lr}"


class Hook:
    """An approval hook as a chat bridge runs it: it receives each request with its approvers' links."""

    def __init__(self) -> None:
        self.got: list[dict] = []
        self.arrived = threading.Condition()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with hook.arrived:
                    hook.got.append(body)
                    hook.arrived.notify_all()
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def request(self, approval_id: str, timeout: float = 30) -> dict:
        with self.arrived:
            assert self.arrived.wait_for(lambda: any(g["id"] == approval_id for g in self.got), timeout), \
                "the hook never got the request"
            return next(g for g in self.got if g["id"] == approval_id)

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def hook():
    h = Hook()
    yield h
    h.close()


def _post(plane, path: str, cookie: str = "", **form) -> object:
    headers = {"content-type": "application/x-www-form-urlencoded", **({"cookie": cookie} if cookie else {})}
    return plane.http.post(path, content=urlencode(form), headers=headers)


def _path(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.path}?{parts.query}"


@needs_prefect
def test_each_approver_gets_a_one_time_link_that_answers_once(control_plane, hook):
    policy = ApprovalPolicyBlock(rules=[ApprovalRule(name="training", kinds=["training"])], timeout_seconds=120,
                                 approval_hook=hook.url)
    t = tenant(control_plane, policy=policy)
    call = RawCall(t, finetune, 0.3)
    call.meta = call.meta.model_copy(update={"parameters": {"lr": "0.3", "steps": "100"}})
    try:
        reply, _ = call.send()
        view = reply.approval
        assert "link=" not in reply.model_dump_json()  # the requester gets no approver's link
        sent = hook.request(view.id)
        assert sorted(sent["links"]) == ["alice", "bob"]  # who may approve it; never the requester
        alice = sent["links"]["alice"]
        assert alice.startswith(f"{control_plane.url}/approve/{view.id}?link=al_")

        page = control_plane.http.get(_path(alice))
        assert page.status_code == 200 and "this link was made for alice" in page.text
        for shown in ("Approve AI task finetune?", "1 H100 GPU", "training of llama-8b", "lr=0.3, steps=100",
                      "30 min", "UTC (in ", "team-a/nightly"):
            assert shown in page.text, shown
        assert 'name="token"' not in page.text  # nothing to paste
        # A link is for its own request only: another id with it shows nothing.
        assert control_plane.http.get(_path(alice).replace(view.id, uuid.uuid4().hex)).status_code == 401

        token = alice.split("link=", 1)[1]
        said = _post(control_plane, f"/approve/{view.id}", link=token, decision="approve", reason="numbers look right")
        assert said.status_code == 200 and "Recorded: alice approved." in said.text
        again = _post(control_plane, f"/approve/{view.id}", link=token, decision="reject")
        assert "Not counted: this link was used already" in again.text
        done, result = call.send(admission=view.id)
        assert done.status == "completed" and result == "trained at 0.3"
    finally:
        call.close()
    d = decision(control_plane.records(call.flow_run_id))
    assert d["approver"] == "alice" and d["channel"] == "link" and d["verified"] is True
    assert d["reason"] == "numbers look right" and d["approver_chains"] == {"alice": ["alice-approves"]}
    # Only the link's hash is stored.
    with control_plane.ledger().engine.connect() as conn:
        rows = conn.execute(sa.text("select * from aisched_approval_links where approval_id = :a"),
                            {"a": view.id}).all()
    assert len(rows) == 2 and not [r for r in rows if token.split("_", 2)[2] in str(tuple(r))]


@needs_prefect
def test_an_approver_signs_in_once_and_answers_with_a_short_id_from_the_cli(control_plane, tmp_path, monkeypatch):
    policy = ApprovalPolicyBlock(rules=[ApprovalRule(name="training", kinds=["training"])], timeout_seconds=120)
    t = tenant(control_plane, policy=policy)
    bob = control_plane.approver("bob", t.authority)
    first, second = RawCall(t, finetune, 0.1), RawCall(t, finetune, 0.2)
    try:
        one, two = first.send()[0].approval, second.send()[0].approval
        # The page's sign-in: the credential once, then a cookie (HttpOnly, SameSite=Lax, for the approval pages).
        signed = _post(control_plane, f"/approve/{one.id}/sign-in", token=bob)
        assert signed.status_code == 303
        cookie = signed.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=lax" in cookie and "Path=/approve" in cookie and bob not in cookie
        session = f"aisched_session={signed.cookies['aisched_session']}"
        page = control_plane.http.get(f"/approve/{one.id}", headers={"cookie": session})
        assert page.status_code == 200 and "signed in as bob" in page.text
        said = _post(control_plane, f"/approve/{one.id}", cookie=session, decision="approve")
        assert "Recorded: bob approved." in said.text
        forged = session[:-4] + "0000"
        assert control_plane.http.get(f"/approve/{two.id}", headers={"cookie": forged}).status_code == 401

        # The CLI lists short ids, and approve takes one.
        path = tmp_path / "bob.token"
        path.write_text(bob)
        monkeypatch.delenv("AISCHED_OPERATOR_TOKEN", raising=False)
        listed = CliRunner().invoke(app, ["approvals", "list", "--token-file", str(path), "--control-plane",
                                          control_plane.url])
        assert listed.exit_code == 0, listed.output
        assert two.id[:8] in listed.output and two.id not in listed.output
        out = CliRunner().invoke(app, ["approve", two.id[:8], "--token-file", str(path), "--control-plane",
                                       control_plane.url])
        assert out.exit_code == 0 and "status approved" in out.output, out.output
        assert control_plane.ok("GET", f"/v1/approvals/{two.id}")["approved_by"] == ["bob"]
    finally:
        first.close()
        second.close()


def test_links_are_stored_hashed_answer_once_and_end_at_the_deadline(sqlite_url):
    """The link book without a server: made for one approver and request, valid until the request's deadline."""
    from aisched_prefect.control.approvals.proof import ApprovalError
    from aisched_prefect.control.approvals.requests import ApprovalBook, approvals
    from aisched_prefect.control.authority.state import AuthorityState
    from aisched_prefect.ledger import Ledger

    ledger = Ledger(sqlite_url)
    book = ApprovalBook(ledger, AuthorityState(ledger), "http://cp")
    ids = [uuid.uuid4().hex, uuid.uuid4().hex]
    ids[1] = ids[0][:8] + ids[1][8:]  # two ids that share the short prefix
    first_deadline = time.time() + 1.0
    with ledger.engine.begin() as conn:
        for i, deadline in zip(ids, (first_deadline, time.time() + 60)):
            conn.execute(approvals.insert().values(
                id=i, digest="d" * 64, call_index=0, flow_run_id="fr", task_run_id="tr", principal="team-a/x",
                status="pending", suspended=False, deadline=deadline, approved_by=[], decided_by=None, reason="",
                view={}, admission={}))
    with pytest.raises(ApprovalError, match="the requester cannot approve its own run"):
        book.make_link(ids[0], "team-a/x")
    url = book.make_link(ids[0], "alice")
    token = url.split("link=", 1)[1]
    holder = book.links.holder(ids[0], token)
    assert holder is not None and holder.principal == "alice" and not holder.used
    assert book.links.holder(ids[1], token) is None  # another request
    assert book.links.holder(ids[0], token[:-2] + "xx") is None  # another secret
    book.links.use(holder)
    with pytest.raises(ApprovalError, match="used already"):
        book.links.use(holder)
    assert book.links.holder(ids[0], token).used
    time.sleep(max(0.0, first_deadline - time.time()) + 0.05)
    assert book.links.holder(ids[0], token) is None  # past the request's deadline
    with pytest.raises(ApprovalError, match="ambiguous"):
        book.resolve(ids[0][:8])
    assert book.resolve(ids[1][:12]) == ids[1] and book.resolve(ids[0]) == ids[0]
