"""Limits on what one caller may send, without a server: the body-size limit of the HTTP app (by Content-Length,
and while a body streams in), and how many requests for a person one credential may have open. Each refusal
names the limit and the setting that raises it."""

from __future__ import annotations

import time
import uuid

import pytest

from aisched_prefect.control.authority.identity import new_credential
from aisched_prefect.errors import TooManyOpenApprovals
from aisched_prefect.settings import Settings

LIMIT = 64 * 1024


class _Credentials:
    def authenticate(self, *_):
        return new_credential(principal="team-a/x", tenant="team-a", role="flow", created_by="op")[1]


class Plane:
    """What the HTTP app reaches before it reads a call's body: the settings and the credential check."""

    settings = Settings(max_call_bytes=LIMIT, max_request_bytes=4096)
    credentials = _Credentials()


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from aisched_prefect.control.http.app import build_app

    with TestClient(build_app(Plane()), raise_server_exceptions=False) as c:
        yield c


def _refused(resp, setting: str) -> None:
    assert resp.status_code == 413, resp.text
    problem = resp.json()
    assert setting in problem["error"] and setting in problem["fix"]


def test_a_call_declared_larger_than_the_limit_is_refused_unread(client):
    resp = client.post("/v1/calls", content=b"x" * (LIMIT + 1), headers={"authorization": "Bearer t"})
    _refused(resp, "AISCHED_MAX_CALL_BYTES")
    assert f"is {LIMIT + 1} bytes, more than the {LIMIT} bytes" in resp.json()["error"]
    assert "pass large data by reference" in resp.json()["fix"]


def test_a_call_streamed_past_the_limit_is_refused_while_it_streams(client):
    def chunks():  # no Content-Length: only counting what arrives can stop it
        for _ in range(1000):
            yield b"x" * 4096

    resp = client.post("/v1/calls", content=chunks(), headers={"authorization": "Bearer t"})
    _refused(resp, "AISCHED_MAX_CALL_BYTES")
    assert f"passed the {LIMIT} bytes this control plane takes" in resp.json()["error"]


def test_other_routes_have_their_own_smaller_limit(client):
    _refused(client.post("/v1/credentials", json={"principal": "x" * 5000}), "AISCHED_MAX_REQUEST_BYTES")


def test_one_credential_may_keep_only_so_many_requests_open(sqlite_url, tmp_path):
    """The check admission runs before it holds anything for a new request: open requests of this credential
    count (answered, expired, or another credential's do not)."""
    from aisched_prefect.control.approvals.requests import ApprovalBook, approvals
    from aisched_prefect.control.authority.credentials import Credentials
    from aisched_prefect.control.service import ControlPlane
    from aisched_prefect.control.authority.state import AuthorityState
    from aisched_prefect.ledger import Ledger

    plane = ControlPlane.__new__(ControlPlane)
    plane.settings = Settings(max_open_approvals=3)
    plane.ledger = Ledger(sqlite_url)
    state = AuthorityState(plane.ledger)
    ApprovalBook(plane.ledger, state)  # its table
    plane.credentials = Credentials(plane.ledger, state, plane.settings)
    me = new_credential(principal="team-a/x", tenant="team-a", role="flow", created_by="op")[1]
    other = new_credential(principal="team-a/x", tenant="team-a", role="flow", created_by="op")[1]

    def ask(cred, status="pending", deadline=None):
        with plane.ledger.engine.begin() as conn:
            conn.execute(approvals.insert().values(
                id=uuid.uuid4().hex, digest="d", call_index=0, flow_run_id="f", task_run_id="t", principal=cred.principal,
                status=status, suspended=False, deadline=deadline or time.time() + 600, approved_by=[], reason="",
                view={}, admission={"credential": cred.id}))

    try:
        for _ in range(2):
            ask(me)
        ask(me, status="approved")
        ask(me, deadline=time.time() - 1)  # expired, not yet swept
        for _ in range(5):
            ask(other)
        plane.credentials.check_open_approvals(me)  # 2 of 3 open: one more may be asked
        ask(me)
        with pytest.raises(TooManyOpenApprovals, match=r"already has 3 requests waiting.*"
                                                       r"AISCHED_MAX_OPEN_APPROVALS=3.*Fix: answer or let expire") as info:
            plane.credentials.check_open_approvals(me)
        assert info.value.status == 429
    finally:
        plane.ledger.close()


@pytest.mark.parametrize("query, field", [
    ("session=" + "s" * 32 + "&wait=nan", "wait"), ("session=" + "s" * 32 + "&wait=inf", "wait"),
    ("session=" + "s" * 32 + "&wait=-1", "wait"), ("session=" + "s" * 32 + "&wait=1e9", "wait"),
    ("session=" + "s" * 32 + "&after=-5", "after"), ("session=" + "s" * 32 + "&after=1e400", "after"),
    ("session=" + "s" * 10_000, "session"), ("session=short", "session"), ("wait=1", "session"),
    ("session=" + "s" * 32 + "&instance=" + "i" * 500, "instance")])
def test_every_outcome_poll_parameter_is_checked_before_anything_waits(client, query, field):
    """`wait=nan` once made a poll wait past its client's patience and kept its session from ever expiring; a
    10,000-character session id was taken. Each is a 422 naming the parameter, answered at once."""
    started = time.monotonic()
    resp = client.get(f"/v1/outcomes?{query}", headers={"authorization": "Bearer t"})
    assert resp.status_code == 422, resp.text
    problem = resp.json()
    assert problem["field"] == field and field in problem["error"] and "Fix: " in problem["error"]
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("wait", ["nan", "-inf", "-0.5", "86400"])
def test_an_approval_poll_takes_only_a_finite_wait_in_range(client, wait):
    resp = client.get(f"/v1/approvals/some-id?wait={wait}", headers={"authorization": "Bearer t"})
    assert resp.status_code == 422 and resp.json()["field"] == "wait", resp.text


def test_a_client_still_sending_an_oversized_call_reads_the_413_naming_the_limit(tmp_path):
    """Over a real socket: the plane answers by Content-Length without keeping the body (it reads and drops a
    bounded part first, so a client that sends it whole reads the answer rather than a reset); the flow's client
    turns the 413 into RequestTooLarge naming AISCHED_MAX_CALL_BYTES, at once. (On loopback a reset is rarely seen
    even without the drain: this checks the client's side and that the answer is readable.)"""
    import socket
    import threading

    import uvicorn

    from aisched_prefect.control.http.app import build_app
    from aisched_prefect.errors import RequestTooLarge
    from aisched_prefect.flow.client import ControlPlaneClient
    from aisched_prefect.wire import CallMeta

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(Plane()), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
            time.sleep(0.05)
        client = ControlPlaneClient([f"http://127.0.0.1:{port}"], "t", retry_seconds=5)
        meta = CallMeta(task_name="t", task_run_id="r", flow_run_id="f", run_key="f/r", request={},
                        code_digest="0" * 64)
        started = time.monotonic()
        with pytest.raises(RequestTooLarge, match="AISCHED_MAX_CALL_BYTES") as caught:
            client.call(meta, b"x" * (8 * 2**20))  # 128 times the limit
        assert time.monotonic() - started < 5  # not retried as if the plane were down
        assert caught.value.setting == "AISCHED_MAX_CALL_BYTES" and caught.value.limit == LIMIT
        client.close()
    finally:
        server.should_exit = True
        thread.join(10)
