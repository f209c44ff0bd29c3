"""A flow that stops while a run waits for a person withdraws its request: its budget is released at once, and an
approval given afterwards is told the run is gone, instead of "approved" for a run that will never run.

Stopped three ways a person stops a flow (Ctrl-C, SIGTERM, Prefect's Cancel), each a real flow process against the
shared control plane; and a flow process that died (no signal at all) through the plane's sweep, as a unit over a
ledger of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.approval_helpers import accounts_of, api_answer
from tests.helpers import PRINCIPAL, ask_for_training, tenant, wait_until

pytestmark = pytest.mark.usefixtures("prefect_api")

FLOW_SCRIPT = textwrap.dedent('''
    import faulthandler, signal, sys
    faulthandler.register(signal.SIGUSR1, file=open(sys.argv[3], "w"), all_threads=True)  # the test's diagnosis
    from prefect import flow
    from prefect.context import FlowRunContext
    from aisched_prefect import AISchedTaskRunner, ai_task

    @ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=30)
    def finetune():
        return "trained"

    @flow(task_runner=AISchedTaskRunner(control_plane=sys.argv[1], credential=sys.argv[2]))
    def waits():
        print(FlowRunContext.get().flow_run.id, flush=True)
        return finetune()

    waits()
''')


def _prefect_state(flow_run_id: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state


def _cancel(flow_run_id: str) -> None:
    """What the Cancel button of Prefect's run page does: propose Cancelling."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Cancelling(message="cancelled from the UI"))


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "prefect-cancel"])
def test_a_waiting_flow_that_is_stopped_withdraws_its_request_within_5_s(control_plane, tmp_path, how):
    from prefect.settings import PREFECT_API_URL

    t = tenant(control_plane, policy=ask_for_training(3600))
    alice = control_plane.approver("alice", t.authority)
    script = tmp_path / "waits.py"
    script.write_text(FLOW_SCRIPT)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])}
    stacks = tmp_path / "stacks.txt"
    proc = subprocess.Popen([sys.executable, str(script), control_plane.url, t.token, str(stacks)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        flow_run_id = proc.stdout.readline().strip()
        assert flow_run_id, proc.stderr.read()[-3000:]

        def asked():
            found = [v for v in control_plane.ok("GET", "/v1/approvals") if v["flow_run_id"] == flow_run_id]
            state = _prefect_state(flow_run_id)
            return found[0] if found and state is not None and state.is_paused() else None

        view = wait_until(asked, 120, what="the flow's run waiting for a person, its flow run paused in Prefect")
        assert view["principal"] == t.principal
        assert sum(a["pending"] for a in accounts_of(control_plane, t)) > 0  # its estimate is held while it waits
        paused = _prefect_state(flow_run_id)
        assert view["url"] in paused.message and "finetune" in paused.message  # the run page says why, and where

        started = time.monotonic()
        if how == "ctrl-c":
            proc.send_signal(signal.SIGINT)
        elif how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            _cancel(flow_run_id)
        try:
            gone = wait_until(lambda: (v := control_plane.ok("GET", f"/v1/approvals/{view['id']}"))["status"]
                              == "withdrawn" and v, 30, what="the request withdrawn")
        except AssertionError as exc:  # say where the flow process is, not only that it did not withdraw
            proc.send_signal(signal.SIGUSR1)
            dumped = wait_until(lambda: "File " in stacks.read_text() and stacks.read_text(), 10, what="stacks")
            raise AssertionError(f"{exc}; the flow process's threads:\n{dumped[-12000:]}") from None
        took = time.monotonic() - started
        assert took < 5.0, f"withdrawn {took:.1f} s after the stop"
        assert "withdrawn" in gone["reason"]
        # Released, and nothing charged: the request ends, then its holds are voided (two writes), so within the
        # same 5 s of the stop rather than at the instant the request reads withdrawn.
        wait_until(lambda: sum(a["pending"] for a in accounts_of(control_plane, t)) == 0,
                   max(0.1, 5.0 - (time.monotonic() - started)), what="the request's holds released")
        assert sum(a["posted"] for a in accounts_of(control_plane, t)) == 0

        late = api_answer(control_plane, view["id"], alice, reason="looks right")
        assert late.status_code == 410 and "is gone" in late.text and "nothing of it will run" in late.text, late.text
        proc.wait(timeout=60)  # and the process ends, not at the request's deadline an hour later
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    kinds = [r.kind for r in control_plane.records(flow_run_id)]
    assert kinds[:1] == ["approval-requested"] and "approval-withdrawn" in kinds and "admission" not in kinds, kinds
    settled = [r.payload for r in control_plane.records(flow_run_id) if r.kind == "settlement"]
    assert [p["outcome"] for p in settled] == ["approval-withdrawn"]
    assert control_plane.ledger().verify().ok


def test_a_request_whose_flow_process_died_is_withdrawn_after_the_lease_and_a_suspended_one_is_kept(sqlite_url):
    """No signal, no goodbye: a request nobody polls for the lease is withdrawn by the plane's sweep (its holds
    released), one still polled is kept, and a suspended deployment run's request (no process by design) is never
    swept."""
    from aisched_prefect.approvals import ApprovalDecision
    from aisched_prefect.control.admission.record import Admission
    from aisched_prefect.control.approvals.proof import ApprovalError
    from aisched_prefect.control.approvals.waiters import Waiters
    from aisched_prefect.control.approvals.requests import ApprovalBook
    from aisched_prefect.control.authority.state import AuthorityState
    from aisched_prefect.ledger import Ledger
    from aisched_prefect.request import AIRequest
    from blocks import BudgetLine, RunFacts

    ledger = Ledger(sqlite_url)
    book = ApprovalBook(ledger, AuthorityState(ledger), "http://cp")
    now = [time.time()]  # the sweep's clock, moved by the test: a loaded host's slow writes do not age a request
    waiters = Waiters(book, lease_seconds=60.0, clock=lambda: now[0])

    def ask(flow_run: str):
        ids = {"flow_run_id": flow_run, "task_run_id": f"tr-{flow_run}", "principal": PRINCIPAL}
        held, record = ledger.reserve([BudgetLine(budget="team", period="p", limit=100, amount=4)],
                                      kind="approval-requested", payload={"task": "finetune"}, **ids)
        admission = Admission(
            id=str(record.seq), credential="c", principal=PRINCIPAL, tenant="team-a", flow_run_id=flow_run,
            task_run_id=ids["task_run_id"], task_name="finetune", flow_name="f", run_key=f"{flow_run}/finetune",
            request=AIRequest.build(kind="training", gpus=1, est_seconds=30), workers=[], holds=held, reserved=4.0,
            priced_type="H100", chain=["team-a-root"], expires_at=None, facts=RunFacts(principal=PRINCIPAL,
            kind="training"), payload_digest="p" * 64, code_digest="c" * 64, approval=str(record.seq),
            approval_digest="d" * 64)
        return book.create(admission, {"approval_digest": "d" * 64, "timeout_seconds": 3600}, "USD")

    dead, alive, suspended = ask("dead"), ask("alive"), ask("suspended")
    book.suspend(suspended.id)
    assert waiters.sweep() == []  # just asked: each was seen when it was filed
    now[0] = time.time() + 61  # a lease later, one flow still polls
    waiters.seen(alive.id)
    assert waiters.sweep() == [dead.id]
    assert book.view(dead.id).status == "withdrawn" and "stopped polling" in book.view(dead.id).reason
    assert book.view(alive.id).status == "pending" and book.view(suspended.id).status == "suspended"
    pending = {a["period"]: a["pending"] for a in ledger.accounts()}
    assert pending == {"p": 4.0}, pending  # only the live request still holds its estimate
    with pytest.raises(ApprovalError) as late:
        book.answer(dead.id, ApprovalDecision(approved=True, approver="alice", channel="credential"), None)
    assert late.value.status == 410 and "is gone" in str(late.value)
    assert waiters.withdraw(dead.id, "again").status == "withdrawn"  # a second withdrawal changes nothing
    assert [r.kind for r in ledger.records("dead")] == ["approval-requested", "approval-withdrawn", "settlement"]
    assert ledger.verify().ok
