"""Code identity without running the code: the `new_flow_version` rule keys on what the control plane received.

Before: the rule keyed on `code_digest`, a field the flow process fills in. After one digest was approved, a call
claiming that digest but sending other bytes (here, a pickle that writes a file as it is loaded) was not asked
again, and its bytes were loaded on a GPU worker; a call with no `flow_name` was "seen before", so it was never
asked. Now the control plane hashes the function's pickled bytes itself (they travel apart from the arguments:
`CallMeta.args_offset`), a call without a flow name is new code, and code is remembered as seen only once a run
of it was admitted without asking or its approval was used (a rejected request teaches nothing).
"""

from __future__ import annotations

import pickle
import uuid

import cloudpickle
import pytest

from aisched_prefect import ai_task
from blocks import ApprovalPolicyBlock, ApprovalRule
from tests.approval_helpers import RawCall, api_answer
from tests.helpers import tenant

pytestmark = pytest.mark.usefixtures("prefect_api")


@ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=5)
def tune(x: int) -> int:
    return x * 2


class _WritesOnLoad:
    """A pickle that runs code as it is loaded: it opens (creates) `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _call(t, flow_name: str | None, x: int = 3) -> RawCall:
    call = RawCall(t, tune, x)
    call.meta = call.meta.model_copy(update={"flow_name": flow_name})
    return call


def test_new_code_is_asked_about_whatever_digest_or_flow_name_the_call_claims(control_plane, tmp_path):
    t = tenant(control_plane, policy=ApprovalPolicyBlock(rules=[ApprovalRule(name="new-code", new_flow_version=True)],
                                                         timeout_seconds=60))
    alice = control_plane.approver("alice", t.authority)
    flow = f"nightly-{uuid.uuid4().hex[:8]}"

    first = _call(t, flow)
    reply, _ = first.send()
    assert reply.status == "approval-pending" and reply.approval.rule == "new-code"
    assert api_answer(control_plane, reply.approval.id, alice).status_code == 200
    done, result = first.send(admission=reply.approval.id)
    assert done.status == "completed" and result == 6
    again = _call(t, flow, 4)  # the same bytes of the same flow, in a new flow run: seen, not asked
    assert again.send()[0].status == "completed"

    # The approved digest and flow name, other bytes: asked again, and the bytes are never loaded.
    marker = tmp_path / "loaded"
    forged = _call(t, flow)
    evil = pickle.dumps(_WritesOnLoad(str(marker)))
    forged.blob = evil + cloudpickle.dumps(((3,), {}))
    forged.meta = forged.meta.model_copy(update={"args_offset": len(evil)})
    asked, _ = forged.send()
    assert asked.status == "approval-pending" and asked.approval.rule == "new-code"
    assert api_answer(control_plane, asked.approval.id, alice, approve=False, reason="not this").status_code == 200
    assert not marker.exists()
    # Rejected bytes were never admitted: they are still new code.
    assert _call(t, flow).send()[0].status == "completed"  # (the approved bytes, still seen)
    forged2 = _call(t, flow)
    forged2.blob, forged2.meta = forged.blob, forged.meta.model_copy(update={"flow_run_id": forged2.flow_run_id,
                                                                            "task_run_id": str(uuid.uuid4())})
    assert forged2.send()[0].status == "approval-pending"

    # No flow name: new code, asked, whatever was approved before.
    nameless = _call(t, None)
    assert nameless.send()[0].status == "approval-pending"
    for c in (first, again, forged, forged2, nameless):
        c.close()
    assert not marker.exists()


def test_nothing_on_the_control_plane_unpickles():
    """The control plane hashes the bytes a flow sends and hands them on; no module of it loads a pickle (the only
    code that does runs in a body's own process on a worker, or in the flow process for its own result)."""
    import ast
    from pathlib import Path

    import aisched_prefect

    root = Path(aisched_prefect.__file__).parent
    plane = [*sorted((root / "control").rglob("*.py")), *sorted((root / "ledger").rglob("*.py")),
             *sorted((root / "reports").rglob("*.py")),
             *(root / n for n in ("approvals.py", "evidence.py", "wire.py", "settings.py"))]
    found = []
    for path in plane:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("load", "loads", "Unpickler") \
                    and isinstance(node.value, ast.Name) and node.value.id in ("pickle", "cloudpickle", "dill", "marshal"):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and node.module in ("pickle", "cloudpickle", "dill", "marshal") \
                    and any(a.name in ("load", "loads", "Unpickler") for a in node.names):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert found == [], found
    assert len(plane) > 60  # the walk saw the control plane's modules, in its folders too
