"""End to end on the session's cluster and control plane: a large result goes from its worker to the flow process.

The control plane's part is what it records and replies: the settlement holds the result's digest and size (and
which way it went), the reply on the outcome stream carries the worker's reference and no bytes. What reaches the
flow is the value; a reference whose digest was altered on the way is refused before the bytes are unpickled, and
the Prefect task run ends Failed with that cause.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import httpx
import pytest
from prefect import flow
from prefect.context import FlowRunContext

from aisched_prefect import ai_task
from aisched_prefect.errors import ResultMismatch
from aisched_prefect.stream import CallStream
from tests.helpers import tenant

pytestmark = pytest.mark.usefixtures("prefect_api")

MiB = 2**20


class Tripwire:
    """A large value whose unpickling touches `path`: the test sees whether the flow loaded it."""

    def __init__(self, path: str, size: int) -> None:
        self.path, self.blob = path, os.urandom(size)

    def __setstate__(self, state: dict) -> None:
        Path(state["path"]).touch()
        self.__dict__.update(state)


@ai_task(gpus=1, kind="inference", est_seconds=10)
def large(path: str, size: int) -> Tripwire:
    return Tripwire(path, size)


@ai_task(gpus=1, kind="inference", est_seconds=10)
def small() -> bytes:
    return b"s" * 1000


@pytest.fixture
def delivered(monkeypatch):
    """Every (reply, bytes) the flow process's outcome stream hands on, as the control plane sent them."""
    seen: list = []
    original = CallStream._deliver

    def spy(self, key, reply, out):
        seen.append((reply, out))
        original(self, key, reply, out)

    monkeypatch.setattr(CallStream, "_deliver", spy)
    return seen


def _settlement(plane, flow_run_id: str, task_name: str):
    (record,) = [r for r in plane.records(flow_run_id) if r.kind == "settlement" and r.payload["task"] == task_name]
    return record


def test_a_large_result_reaches_the_flow_from_its_worker_never_through_the_plane(control_plane, delivered, tmp_path):
    marker = tmp_path / "loaded"
    t = tenant(control_plane)

    @flow(task_runner=t.runner())
    def produce():
        value = large(str(marker), 3 * MiB)
        return value, small(), FlowRunContext.get().flow_run.id

    value, little, flow_run_id = produce()
    assert isinstance(value, Tripwire) and len(value.blob) == 3 * MiB and marker.exists()
    assert little == b"s" * 1000
    (big_reply, big_out), = [(r, o) for r, o in delivered if r.result_ref is not None]
    assert big_out == b"" and big_reply.status == "completed"  # the stream carried no byte of it
    ref = big_reply.result_ref
    assert ref.size > 3 * MiB and ref.digest == big_reply.result_digest
    settled = _settlement(control_plane, flow_run_id, "large").payload
    assert settled["result_via"] == "worker" and settled["result_digest"] == ref.digest
    assert settled["result_bytes"] == ref.size and ref.token not in str(settled)
    # The small one took the usual way: its bytes on the stream, checked against the recorded digest.
    (small_reply, small_out), = [(r, o) for r, o in delivered if r.result_ref is None and r.status == "completed"]
    assert 0 < len(small_out) < MiB and hashlib.sha256(small_out).hexdigest() == small_reply.result_digest
    assert _settlement(control_plane, flow_run_id, "small").payload["result_via"] == "control-plane"
    # Fetched once: the token opens nothing any more, and a guessed one never did.
    assert httpx.get(f"{ref.url}/results/{ref.token}", trust_env=False).status_code == 404
    assert httpx.get(f"{ref.url}/results/{'x' * 43}", trust_env=False).status_code == 404


def test_a_reference_altered_on_the_way_fails_the_task_run_and_is_never_loaded(control_plane, monkeypatch, tmp_path):
    marker = tmp_path / "loaded"
    original = CallStream._deliver

    def tamper(self, key, reply, out):  # as if the reply's digest had been changed between the plane and the flow
        if reply.result_ref is not None:
            other = hashlib.sha256(b"something else").hexdigest()
            reply = reply.model_copy(update={"result_digest": other,
                                             "result_ref": reply.result_ref.model_copy(update={"digest": other})})
        original(self, key, reply, out)

    monkeypatch.setattr(CallStream, "_deliver", tamper)

    @flow(task_runner=tenant(control_plane).runner())
    def produce():
        state = large(str(marker), 2 * MiB, return_state=True)
        return state.type.value, state.is_final(), state.result(raise_on_failure=False)

    kind, final, error = produce()
    assert (kind, final) == ("FAILED", True)
    assert isinstance(error, ResultMismatch) and "not the one the control plane recorded" in str(error)
    assert "not unpickled" in str(error) and "Fix: " in str(error)
    assert not marker.exists()
