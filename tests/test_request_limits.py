"""Limits on what one caller may send, without a server: the body-size limit of the HTTP app (by Content-Length,
and while a body streams in), and how many requests for a person one credential may have open. Each refusal
names the limit and the setting that raises it."""

from __future__ import annotations

import time
import uuid

import pytest

from aisched_prefect.control.identity import new_credential
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

    from aisched_prefect.control.app import build_app

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
    from aisched_prefect.control.approvals import ApprovalBook, approvals
    from aisched_prefect.control.credentials import Credentials
    from aisched_prefect.control.service import ControlPlane
    from aisched_prefect.control.state import AuthorityState
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
