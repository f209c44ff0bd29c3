"""A real flow sending a call larger than the control plane takes (40 MB against AISCHED_MAX_CALL_BYTES' 32 MiB):
its task run fails at once with RequestTooLarge naming the setting, nothing is admitted or held.

Why: the plane refused such a body unread and closed the connection; the flow's client saw a reset, took the plane
for down and failed after 133 s with "ControlPlaneUnavailable ... Fix: start it" (issue 31).
"""

from __future__ import annotations

import time

import pytest
from prefect import flow
from prefect.context import FlowRunContext

from aisched_prefect import ai_task
from tests.helpers import tenant

pytestmark = pytest.mark.usefixtures("prefect_api")


@ai_task(gpus=1, gpu_type="A10", kind="inference", est_seconds=30)
def takes(blob: bytes) -> int:
    return len(blob)


def test_a_40_mb_call_from_a_real_flow_fails_at_once_naming_the_limit(control_plane):
    t = tenant(control_plane)
    ids: list[str] = []

    @flow(task_runner=t.runner())
    def sends():
        ids.append(str(FlowRunContext.get().flow_run.id))
        future = takes.submit(b"x" * (40 * 2**20))
        future.wait()
        return future.state.is_failed(), future.state.message or ""

    started = time.monotonic()
    failed, message = sends()
    assert time.monotonic() - started < 60  # not retried for minutes as if the plane were down
    assert failed and "RequestTooLarge" in message and "AISCHED_MAX_CALL_BYTES=33554432" in message, message
    assert control_plane.records(ids[0]) == []  # nothing admitted, held or recorded
