"""A person approves a paused run from the Prefect UI, in a real (headless) Chromium.

Starts `prefect server start` on 127.0.0.1 and runs a flow that pauses for
approval in its own process, as `python nightly_finetune.py` would, against
the session's control plane. The browser opens the flow run's page in the
Prefect UI, clicks *Resume*, follows the form's link to the control plane's
approval page, signs in there with the approver's credential and clicks
*Approve*; the flow run completes, and the evidence names the approver as the
control plane identified them. Needs Debian's chromium and the `playwright`
package (`.ci/run` installs both); skipped elsewhere unless
AISCHED_REQUIRE_BROWSER=1. AISCHED_SCREENSHOTS=DIR keeps the screenshots (the
README's pictures in docs/ come from here).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.approval_helpers import decision
from tests.helpers import ask_for_training, tenant

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ROOT = Path(__file__).parent.parent


def _browser_or_skip() -> None:
    try:
        import playwright  # noqa: F401
    except ImportError:
        missing = "the playwright package"
    else:
        missing = None if CHROMIUM else "chromium (apt-get install chromium)"
    if missing:
        if os.environ.get("AISCHED_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{missing} is not installed; .ci/run should have installed it")
        pytest.skip(f"{missing} is not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _paused_run(api: str, name: str, deadline: float, run: subprocess.Popen) -> str:
    while time.time() < deadline and run.poll() is None:
        runs = httpx.post(f"{api}/flow_runs/filter", json={"flows": {"name": {"any_": [name]}}}).json()
        if runs and runs[0]["state"]["type"] == "PAUSED":
            return runs[0]["id"]
        time.sleep(0.3)
    run.kill()
    raise AssertionError(f"the flow run never paused for approval; its output:\n{run.communicate()[0]}")


FLOW = '''
import json, sys
from prefect import flow
from aisched_prefect import AdmissionDenied, AISchedTaskRunner, ai_task

@ai_task(gpus=1, gpu_type="H100", kind="training", model="llama-8b", est_seconds=1800)
def finetune():
    return "trained"

# The control plane's address and this flow's credential come from AISCHED_CONTROL_PLANE and AISCHED_TOKEN.
@flow(name=sys.argv[1], task_runner=AISchedTaskRunner())
def nightly_finetune():
    try:
        return finetune()
    except AdmissionDenied as exc:
        return f"denied: {exc}"

print("RESULT " + json.dumps(nightly_finetune()))
'''


@pytest.mark.timeout(900)
def test_a_person_approves_from_the_prefect_ui_on_the_control_planes_page(control_plane, tmp_path):
    _browser_or_skip()
    from playwright.sync_api import sync_playwright

    t = tenant(control_plane, policy=ask_for_training(300))
    alice = control_plane.approver("alice", t.authority)
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": api,
           "PREFECT_UI_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "WARNING",
           "PYTHONPATH": str(ROOT), "AISCHED_CONTROL_PLANE": control_plane.url, "AISCHED_TOKEN": t.token}
    env.pop("PREFECT_API_KEY", None)
    server_log = tmp_path / "server.log"
    with open(server_log, "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                   "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    script = tmp_path / "nightly_finetune.py"
    script.write_text(FLOW)
    name = f"ui-approval-{port}"
    run = None
    try:
        deadline = time.time() + 300  # a busy machine can take minutes to migrate a new database
        while True:
            try:
                if httpx.get(f"{api}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.time() < deadline, \
                f"the Prefect server never answered on {api}:\n{server_log.read_text(errors='replace')[-3000:]}"
            time.sleep(0.5)
        run = subprocess.Popen([sys.executable, str(script), name], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        flow_run_id = _paused_run(api, name, time.time() + 120, run)
        shots = Path(os.environ.get("AISCHED_SCREENSHOTS") or tmp_path)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            context = browser.new_context(viewport={"width": 1300, "height": 1050})
            page = context.new_page()
            page.goto(f"http://127.0.0.1:{port}/runs/flow-run/{flow_run_id}")
            # The run page says why it waits and where to answer: the flow's log line, with the plane's link.
            page.get_by_text("waits for an approver").first.wait_for(timeout=60_000)
            page.get_by_text(f"{control_plane.url}/approve/").first.wait_for(timeout=10_000)  # its link, beside it
            # Prefect's own Submit does not count: the run's log says so on the page, and the run pauses again.
            page.get_by_role("button", name="Resume").click()
            page.get_by_role("dialog").get_by_text("Approve AI task").wait_for(timeout=30_000)
            page.get_by_role("dialog").get_by_role("button", name="Submit").click()
            page.get_by_text("was not counted").first.wait_for(timeout=60_000)
            _paused_run(api, name, time.time() + 120, run)
            page.reload()
            page.get_by_role("button", name="Resume").click()
            dialog = page.get_by_role("dialog")
            dialog.get_by_text("Approve AI task").wait_for(timeout=30_000)
            link = dialog.locator(f"a[href*='{control_plane.url}/approve/']").first
            link.wait_for(timeout=30_000)
            # The form shows the request and the link only: no Approve toggle, no field that would count for nothing.
            assert dialog.locator("input, textarea, select, [role=switch], [role=checkbox]").count() == 0
            dialog.screenshot(path=str(shots / "approval-form.png"))
            href = link.get_attribute("href")
            assert href and href.startswith(f"{control_plane.url}/approve/"), href
            approval_id = href.rsplit("/", 1)[1]
            # Bob got a one-time link from the approval hook (here an operator makes it): it opens the request.
            bobs = control_plane.ok("POST", f"/v1/approvals/{approval_id}/links", json={"approver": "bob"})["url"]
            link_page = context.new_page()
            link_page.goto(bobs)
            link_page.get_by_text("this link was made for bob").wait_for(timeout=10_000)
            link_page.screenshot(path=str(shots / "approval-link.png"), full_page=True)
            link_page.close()
            # Follow the form's link as a person does (the UI may open it in a new tab): a sign-in, nothing shown.
            with context.expect_page(timeout=10_000) as opened:
                link.click()
            approve_page = opened.value
            approve_page.wait_for_load_state()
            assert approve_page.url == href
            assert "finetune" not in approve_page.content()
            approve_page.get_by_label("Approver credential").fill(alice)
            approve_page.screenshot(path=str(shots / "approval-signin.png"))
            approve_page.get_by_role("button", name="Sign in").click()
            approve_page.get_by_text("Approve AI task finetune?").wait_for(timeout=10_000)
            approve_page.get_by_text("signed in as alice").wait_for(timeout=10_000)
            assert "1 H100 GPU" in approve_page.content()
            approve_page.get_by_label("Reason").fill("eval numbers look right; go")
            approve_page.screenshot(path=str(shots / "approval-page.png"), full_page=True)
            approve_page.get_by_role("button", name="Approve").click()
            approve_page.get_by_text("Recorded: alice approved.").wait_for(timeout=10_000)
            assert "Approve" not in [b.inner_text() for b in approve_page.get_by_role("button").all()]  # decided
            approve_page.close()
            page.bring_to_front()
            dialog.get_by_role("button", name="Close").click()  # nothing to submit in Prefect's form
            page.get_by_text("Completed").first.wait_for(timeout=120_000)
            page.screenshot(path=str(shots / "approved-run.png"))
            browser.close()
        out, _ = run.communicate(timeout=120)
    finally:
        if run is not None and run.poll() is None:
            run.kill()
        server.terminate()
        server.wait(timeout=30)
    assert 'RESULT "trained"' in out, out
    d = decision(control_plane.records(flow_run_id))
    assert d["approver"] == "alice" and d["approved"] is True and d["channel"] == "credential"
    assert d["reason"] == "eval numbers look right; go" and d["verified"] is True
    assert d["approver_chains"] == {"alice": ["alice-approves"]}
    kinds = [r.kind for r in control_plane.records(flow_run_id)]
    assert kinds == ["approval-requested", "approval-unverified", "approval", "approval-consumed", "admission",
                     "settlement"]
