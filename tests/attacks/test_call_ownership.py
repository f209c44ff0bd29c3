"""Calls belong to their caller: a task run id is readable in Prefect, so another tenant can send it.

Before: the control plane keyed a call by `{task_run_id}/{attempt}` alone. A, calling under its own flow run with
B's task run id, received B's stored reply (B's result, error and log lines); and A could claim `{B's task run}/2`
first with a call that was denied, so that B's retry got A's denial. Now a call's key includes the caller's
identity, and a task run id is refused to every principal but the first that called under it.
"""

from __future__ import annotations

import uuid

import pytest

from aisched_prefect.flow.client import ControlPlaneError
from tests.approval_helpers import RawCall
from tests.attacks.support import infer, tenant

pytestmark = pytest.mark.usefixtures("prefect_api")


def _as(call: RawCall, **update) -> RawCall:
    call.meta = call.meta.model_copy(update=update)
    return call


def test_another_tenants_task_run_id_is_refused_and_its_reply_is_never_returned(control_plane):
    a = tenant(control_plane, principal=f"team-a-{uuid.uuid4().hex[:6]}/nightly")
    b = tenant(control_plane, principal=f"team-b-{uuid.uuid4().hex[:6]}/etl")
    theirs = RawCall(b, infer, 41)
    mine = RawCall(a, infer, 1)
    try:
        reply, result = theirs.send()
        assert reply.status == "completed" and result == 41
        # A replays B's task run (attempt 1: B's stored reply), under A's own flow run.
        _as(mine, task_run_id=theirs.meta.task_run_id)
        with pytest.raises(ControlPlaneError) as refused:
            mine.send()
        assert refused.value.status == 403
        assert f"task run {theirs.meta.task_run_id} belongs to another principal" in str(refused.value)
        # A claims B's next attempt first: refused too, so it cannot plant a reply for B's retry.
        _as(mine, attempt=2)
        with pytest.raises(ControlPlaneError) as early:
            mine.send()
        assert early.value.status == 403
        retry, result = _as(theirs, attempt=2).send()
        assert retry.status == "completed" and result == 41
    finally:
        theirs.close()
        mine.close()
    kinds = [r.kind for r in control_plane.records(mine.flow_run_id)]
    assert kinds == []  # nothing was filed under A's flow run for B's task run
