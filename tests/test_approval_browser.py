"""A person approves a paused run in the Prefect UI, in a real (headless) Chromium.

Starts `prefect server start` on 127.0.0.1, runs a flow that pauses for
approval in its own process, opens the flow run's page, clicks *Resume*,
fills the typed form as a person would, submits, and checks that the flow
continues and the evidence records the approver. Needs Debian's chromium and
the `playwright` package (`.ci/run` installs both); skipped elsewhere unless
AISCHED_REQUIRE_BROWSER=1. AISCHED_SCREENSHOTS=DIR keeps the form's screenshot
(the README's picture comes from here).
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

from aisched_prefect import Ledger

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


def _paused_run(api: str, name: str, deadline: float) -> str:
    while time.time() < deadline:
        runs = httpx.post(f"{api}/flow_runs/filter", json={"flows": {"name": {"any_": [name]}}}).json()
        if runs and runs[0]["state"]["type"] == "PAUSED":
            return runs[0]["id"]
        time.sleep(0.3)
    raise AssertionError("timed out")


FLOW = '''
import json, sys
from prefect import flow
from aisched_prefect import AdmissionDenied, ai_task
from tests.helpers import ask_for_training, runner

@ai_task(gpus=1, gpu_type="H100", kind="training", model="llama-8b", est_seconds=1800)
def finetune():
    return "trained"

@flow(name=sys.argv[3], task_runner=runner(sys.argv[1], sys.argv[2], approval_policy=ask_for_training(120)))
def nightly_finetune():
    try:
        return finetune()
    except AdmissionDenied as exc:
        return f"denied: {exc}"

print("RESULT " + json.dumps(nightly_finetune()))
'''


def test_a_person_approves_in_the_prefect_ui(gpu_cluster, sqlite_url, tmp_path):
    _browser_or_skip()
    from playwright.sync_api import sync_playwright

    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": api,
           "PREFECT_UI_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "WARNING",
           "PYTHONPATH": str(ROOT)}
    env.pop("PREFECT_API_KEY", None)
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                               "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    script = tmp_path / "nightly_finetune.py"
    script.write_text(FLOW)
    name = f"ui-approval-{port}"
    run = None
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"{api}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        run = subprocess.Popen([sys.executable, str(script), gpu_cluster.scheduler_address, sqlite_url, name],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            flow_run_id = _paused_run(api, name, time.time() + 120)
        except AssertionError:
            run.kill()
            raise AssertionError(f"the flow run never paused for approval; its output:\n{run.communicate()[0]}") from None
        shots = Path(os.environ.get("AISCHED_SCREENSHOTS") or tmp_path)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1300, "height": 1050})
            page.goto(f"http://127.0.0.1:{port}/runs/flow-run/{flow_run_id}")
            page.get_by_role("button", name="Resume").click()
            dialog = page.get_by_role("dialog")
            dialog.get_by_text("Approve AI task").wait_for(timeout=30_000)
            toggle = dialog.locator("input[type=checkbox]").first
            toggle.locator("xpath=..").click()  # the switch a person clicks; the checkbox itself is hidden
            assert toggle.is_checked()
            fields = dialog.locator("textarea")
            fields.nth(0).fill("alice")
            fields.nth(1).fill("eval numbers look right; go")
            dialog.screenshot(path=str(shots / "approval-form.png"))
            dialog.get_by_role("button", name="Submit").click()
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
    approval = [r for r in Ledger(sqlite_url).records() if r.kind == "approval"][-1].payload
    assert approval["approver"] == "alice" and approval["approved"] is True and approval["channel"] == "prefect-pause"
    assert approval["reason"] == "eval numbers look right; go" and approval["verified"] is False
    assert approval["approver_chains"] == {"alice": ["alice-approves"]}
