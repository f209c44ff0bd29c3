"""End to end on the session's cluster and control plane: a large result goes from its worker to the flow process.

The control plane's part is what it records and replies: the settlement holds the result's digest and size (and
which way it went), the reply on the outcome stream carries the worker's reference and no bytes, and no table of the
ledger holds the one-time token (the call book keeps it sealed under the plane's key). What reaches the flow is the
value; a reference whose digest was altered on the way is refused before the bytes are unpickled, and the Prefect
task run ends Failed with that cause; a result that could not be fetched fails the task run with ResultLost and
leaves a `result-lost` record beside the run's settlement (charged as it ran).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path

import httpx
import pytest
from prefect import flow
from prefect.context import FlowRunContext

from aisched_prefect import ai_task
from aisched_prefect.flow.direct import fetch_result_sync
from aisched_prefect.errors import ResultLost, ResultMismatch
from aisched_prefect.flow.stream import CallStream
from tests.approval_helpers import RawCall
from tests.helpers import ledger_text, send_raw, tenant

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
    assert ref.token not in ledger_text(control_plane)  # no table of the ledger holds the token (the call book: sealed)
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


def test_the_call_book_keeps_the_token_sealed_and_a_call_sent_again_gets_its_result(control_plane, tmp_path):
    """The plane files each completed call's reply (a flow re-attaching after a replica died or restarted gets it):
    its digest, size and worker in clear, its token only sealed under the plane's key. The same call sent again
    gets the reference back, opened, and the bytes are fetched and check out."""
    marker = tmp_path / "loaded"
    call = RawCall(tenant(control_plane), large, str(marker), 2 * MiB)
    try:
        first = send_raw(call)
        assert first.status == "completed" and first.result_ref is not None
        ref = first.result_ref
        text = ledger_text(control_plane)
        assert ref.token not in text and ref.digest in text and ref.url in text
        again = send_raw(call)  # its answer was "lost": the call book's reply, never a second run
        assert again.status == "completed" and again.result_ref == ref and again.admission == first.admission
        value = pickle.loads(fetch_result_sync(again.result_ref, "large"))
        assert isinstance(value, Tripwire) and len(value.blob) == 2 * MiB
    finally:
        call.close()
    kinds = [r.kind for r in control_plane.records(call.flow_run_id)]
    assert kinds.count("settlement") == 1 and "result-lost" not in kinds


def test_a_result_that_cannot_be_fetched_fails_its_task_run_and_leaves_a_record_naming_why(control_plane, monkeypatch,
                                                                                        tmp_path):
    marker = tmp_path / "loaded"
    taken: list = []
    original = CallStream._deliver

    def first(self, key, reply, out):  # someone fetches it before the flow does
        if reply.result_ref is not None:
            got = httpx.get(f"{reply.result_ref.url}/results/{reply.result_ref.token}", trust_env=False)
            taken.append((key, reply.result_ref, got.status_code))
        original(self, key, reply, out)

    monkeypatch.setattr(CallStream, "_deliver", first)
    t = tenant(control_plane)

    @flow(task_runner=t.runner())
    def produce():
        state = large(str(marker), 2 * MiB, return_state=True)
        return state.type.value, state.result(raise_on_failure=False), FlowRunContext.get().flow_run.id

    kind, error, flow_run_id = produce()
    (key, ref, status), = taken
    assert status == 200 and kind == "FAILED" and isinstance(error, ResultLost)
    assert "HTTP 404" in str(error) and not marker.exists()
    settled = _settlement(control_plane, flow_run_id, "large")
    assert settled.payload["outcome"] == "completed" and settled.payload["result_via"] == "worker"
    assert settled.payload["charges"]  # charged as it ran
    lost = [r for r in control_plane.records(flow_run_id) if r.kind == "result-lost"]
    assert len(lost) == 1, lost
    assert {k: v for k, v in lost[0].payload.items() if k != "sig"} == {"call": key, "task": "large", "admission": settled.payload["admission"],
                               "worker": ref.url, "reason": lost[0].payload["reason"], "settlement": settled.seq,
                               "reported_by": t.principal}
    assert lost[0].payload["reason"].startswith("HTTP 404") and lost[0].seq > settled.seq and lost[0].payload["sig"]
    assert lost[0].task_run_id == settled.task_run_id and ref.token not in str(lost[0].payload)
    # Reported again: the record already filed. Another tenant cannot file one about this call; nor an operator.
    again = control_plane.request("POST", "/v1/results/lost", t.token, json={"key": key, "reason": "again"})
    assert again.status_code == 200 and again.json() == {"record": lost[0].seq, "kind": "result-lost", "already": True}
    other = tenant(control_plane)
    assert control_plane.request("POST", "/v1/results/lost", other.token, json={"key": key}).status_code == 404
    assert control_plane.request("POST", "/v1/results/lost", None, json={"key": key}).status_code == 403
    assert [r.kind for r in control_plane.records(flow_run_id)].count("result-lost") == 1
