"""The shipped Prometheus alert rules are valid (`promtool check rules`) and fire where they should, and not before
(`promtool test rules` over deploy/prometheus/rules_test.yml); the scrape configuration beside them parses."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")


def needs(tool: str | None, what: str) -> pytest.MarkDecorator:
    """Skipped without Debian's prometheus package (saying so), except under CI (AISCHED_REQUIRE_PROMETHEUS=1), where
    the test runs and fails on the missing tool."""
    required = os.environ.get("AISCHED_REQUIRE_PROMETHEUS") == "1"
    return pytest.mark.skipif(tool is None and not required,
                              reason=f"{what} (Debian's prometheus package: apt-get install prometheus) is not installed")


needs_promtool = needs(PROMTOOL, "promtool")


def _promtool(*args: str, cwd: Path = DEPLOY, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL, "promtool is not installed: apt-get install prometheus"
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120, input=stdin)  # type: ignore[list-item]


@needs_promtool
def test_the_shipped_rules_are_valid():
    done = _promtool("check", "rules", "aisched-rules.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 8 rules found" in done.stdout


@needs_promtool
def test_the_shipped_rules_pass_their_unit_tests():
    done = _promtool("test", "rules", "rules_test.yml")
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_every_alert_the_issue_asks_for_is_shipped_and_unit_tested():
    rules = (DEPLOY / "aisched-rules.yml").read_text()
    tested = (DEPLOY / "rules_test.yml").read_text()
    for alert in ("AISchedBudgetAt80Percent", "AISchedBudgetExhausted", "AISchedTenantStarved", "AISchedPlaneDown",
                  "AISchedSchedulerDown", "AISchedLedgerCommitsSlow", "AISchedApprovalAboutToTimeOut"):
        assert f"alert: {alert}" in rules
        assert f"alertname: {alert}\n        exp_alerts:\n          - exp_labels" in tested, f"{alert} never fires in a test"


@needs_promtool
def test_the_example_scrape_configuration_parses(tmp_path):
    token = tmp_path / "aisched-operator.token"
    token.write_text("x")
    config = (DEPLOY / "prometheus.yml").read_text().replace("/etc/prometheus/aisched-operator.token", str(token))
    (tmp_path / "prometheus.yml").write_text(config)
    shutil.copy(DEPLOY / "aisched-rules.yml", tmp_path)
    done = _promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
