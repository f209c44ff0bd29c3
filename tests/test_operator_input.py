"""What an operator (or a caller) sends the real control plane, and what it refuses at once, naming the field
and the fix: a call too large to read, a principal no credential can carry, a credential bound to configuration
that is not applied, an apply with a name the books cannot carry (recorded nowhere), an operator command run
with a flow's credential, and one request for a person too many."""

from __future__ import annotations

import json
import socket
import sys
import uuid
from urllib.parse import urlsplit

import pytest

from aisched_prefect import ai_task
from aisched_prefect.control.authority.state import block_body
from tests.helpers import authority, budget


def _cli(monkeypatch, capsys, env: dict[str, str], *args: str) -> tuple[int, str]:
    """`aisched ARGS` as a shell runs it (its own error formatting), with only `env` of the AISCHED_* variables."""
    from aisched_prefect import cli

    for var in ("AISCHED_TOKEN", "AISCHED_OPERATOR_TOKEN", "AISCHED_CONTROL_PLANE"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(sys, "argv", ["aisched", *args])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    return exited.value.code, capsys.readouterr().err


def test_a_call_declared_larger_than_the_limit_is_answered_before_its_body_is_sent(control_plane):
    """300 MB announced and never sent: the plane answers 413 at once (it would hang reading it otherwise)."""
    url = urlsplit(control_plane.url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/calls HTTP/1.1\r\nHost: plane\r\nAuthorization: Bearer x\r\n"
                     b"Content-Type: application/x-aisched-frame\r\nContent-Length: 300000000\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert "AISCHED_MAX_CALL_BYTES" in json.loads(body)["error"]


@pytest.mark.parametrize("principal, rule", [
    ("p" * 100_000, "1 to 200 characters"),
    ("team-a/\x00nightly", "no NUL byte"),
    (" team-a/nightly", "space around it"),
    ("team-a/*", "not a pattern"),
])
def test_a_principal_no_credential_can_carry_is_refused_naming_it(control_plane, principal, rule):
    t = control_plane.tenant(authority(), budget())
    resp = control_plane.request("POST", "/v1/credentials", json={"principal": principal, "tenant": "team-a",
                                                                  "authority": t.authority, "budget": t.budget})
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert error.startswith("principal=") and rule in error and "Fix: name exactly one principal" in error
    assert len(error) < 600  # the value is named by its start and length, not pasted whole


def test_a_credential_bound_to_what_is_not_applied_is_refused_at_once(control_plane, monkeypatch, capsys):
    t = control_plane.tenant(authority(), budget())
    env = {"AISCHED_CONTROL_PLANE": control_plane.url, "AISCHED_OPERATOR_TOKEN": control_plane.operator_token}
    code, err = _cli(monkeypatch, capsys, env, "credentials", "issue", "team-a/x", "--authority", "nope",
                     "--budget", t.budget)
    assert code == 1 and "authority='nope': no authority 'nope' is applied on this control plane (applied:" in err
    assert "Fix: apply it first (aisched apply --authority 'nope'), or name an applied one with --authority" in err
    code, err = _cli(monkeypatch, capsys, env, "credentials", "issue", "team-a/x", "--authority", t.authority,
                     "--budget", "nope-budget")
    assert code == 1 and "no budget 'nope-budget' is applied" in err


def test_an_operator_command_with_a_flow_credential_names_the_operator_token(control_plane, monkeypatch, capsys, tmp_path):
    """The walk-through's `export AISCHED_TOKEN=...` (a flow's), then an operator command."""
    t = control_plane.tenant(authority(), budget())
    env = {"AISCHED_CONTROL_PLANE": control_plane.url, "AISCHED_TOKEN": t.token, "AISCHED_HOME": str(tmp_path)}
    for args in (["workers"], ["credentials", "revoke", "0123456789abcdef"]):
        code, err = _cli(monkeypatch, capsys, env, *args)
        assert code == 1 and "HTTP 403" in err and "a flow credential may not do this (needs operator)" in err
        assert "Fix: " in err and "AISCHED_OPERATOR_TOKEN" in err and "--token-file" in err


def test_a_refused_apply_leaves_nothing_and_blocks_nothing(control_plane):
    name = "b" * 5000
    resp = control_plane.request("POST", f"/v1/config/budget/{name}", json=block_body(budget()))
    assert resp.status_code == 422 and "budget name=" in resp.json()["error"] and "Fix: " in resp.json()["error"]
    applied = control_plane.ok("GET", "/v1/config")
    assert all(len(c["name"]) <= 100 for c in applied)
    assert not [r for r in control_plane.ledger().records() if r.kind == "config-applied" and r.payload["name"] == name]
    later = f"t-{uuid.uuid4().hex[:8]}"
    assert control_plane.apply("budget", later, budget(7.0))["version"] == 1
    assert control_plane.apply("authority", later, authority())["version"] == 1


@ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=30)
def finetune_part(i: int) -> str:
    return f"trained {i}"


def test_a_credential_with_its_requests_open_is_refused_one_more(tmp_path, plane_home, gpu_cluster, prefect_api):
    """A control plane that lets one credential keep 1 request for a person open: while one flow run of it waits
    for a person, another's ask is refused at once (429, naming AISCHED_MAX_OPEN_APPROVALS), nothing held for it.

    (The check counts requests already filed: asks of one credential racing each other can pass it together.)"""
    import shutil

    from tests.approval_helpers import Gated, page_answer
    from tests.controlplane import ControlPlaneProcess
    from tests.helpers import ask_for_training, tenant

    home = tmp_path / "plane"
    home.mkdir()
    shutil.copy(plane_home / "control.key", home / "control.key")  # the key the session's workers trust
    plane = ControlPlaneProcess(home, dask_address=gpu_cluster.scheduler_address, dask_tls=plane_home / "tls",
                                env={"AISCHED_MAX_OPEN_APPROVALS": "1"}).start()

    def run_it():
        try:
            return finetune_part(1)
        except Exception as exc:  # the refused call fails its task, and so its flow run
            return f"failed: {exc}"

    try:
        t = tenant(plane, policy=ask_for_training(120))
        waiting = Gated(t, run_it)
        first = waiting.approval()
        refused = Gated(t, run_it).outcome(timeout=120)
        assert refused.startswith("failed") and "AISCHED_MAX_OPEN_APPROVALS=1" in refused, refused
        assert "already has 1 requests waiting for a person" in refused
        page_answer(plane, first.id, plane.approver("alice", t.authority), reason="one at a time")
        assert waiting.outcome(timeout=120) == "trained 1"
        asked = [r for r in plane.ledger().records() if r.kind == "approval-requested"]
        assert len(asked) == 1  # nothing was held or recorded for the refused one
    finally:
        plane.stop()
