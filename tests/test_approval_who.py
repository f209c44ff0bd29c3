"""A request for approval names who may answer it: the console line (and the Prefect UI's log), the Prefect form's
description and the control plane's page each say the approvers whose grants cover the run (the requester excluded)."""

from __future__ import annotations

import time

import pytest

from aisched_prefect.words import who_may_approve
from tests.approval_helpers import Gated, outcome, page_answer
from tests.helpers import ask_for_training, tenant
from tests.test_approvals import finetune, form_description

pytestmark = pytest.mark.usefixtures("prefect_api")


def _logged(flow_run_id: str, needle: str, timeout: float = 90) -> str:
    """The flow run's log line holding `needle`, as Prefect's API has it (what its UI and the console show)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            for log in logs:
                if needle in log.message:
                    return log.message
            time.sleep(0.5)
    raise AssertionError(f"no log line of flow run {flow_run_id} says {needle!r}")


def test_the_console_line_the_form_and_the_page_name_who_may_approve(control_plane):
    t = tenant(control_plane, policy=ask_for_training(120))
    g = Gated(t, lambda: outcome(finetune))
    alice = control_plane.approver("alice", t.authority)
    view = g.approval()
    assert view.approvers == ["alice", "bob"]  # the helpers' authority: both may approve training; nobody else
    line = _logged(g.flow_run_id, "waits for an approver")
    assert "waits for an approver (alice or bob)" in line
    assert "- who may approve: alice or bob" in form_description(g.paused())
    page = control_plane.http.get(f"/approve/{view.id}", headers={"authorization": f"Bearer {alice}"}).text
    assert "<th>who may approve</th><td>alice or bob</td>" in page
    assert "Recorded: alice approved." in page_answer(control_plane, view.id, alice, reason="named, answered")
    assert g.outcome() == "trained"


def test_many_approvers_are_named_by_the_first_few_and_none_says_how_to_get_one():
    assert who_may_approve(["carol"]) == "carol"
    many = who_may_approve([f"p{i}" for i in range(9)])
    assert many.startswith("one of p0, p1, p2, p3, p4, p5 and 3 more")
    assert "can_approve" in who_may_approve([])
