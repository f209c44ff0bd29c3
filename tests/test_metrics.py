"""Prometheus metrics of the control plane and the cluster's queue, scraped by a real Prometheus.

Debian's `prometheus` is started by the test on 127.0.0.1 (its own scratch folder and port) and scrapes the session
plane's `/metrics` and `/metrics/queue` every second during a real `.map()`; PromQL over its HTTP API sees the
map's admissions and its tenant's queue depth rise and fall back to zero. No metric carries a task key, a task run
id, an argument or a token; a plane listening beyond loopback refuses a scrape without the operator's credential.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest
from prefect import flow
from prefect.context import FlowRunContext

from aisched_prefect import ai_task
from tests.helpers import tenant, wait_until
from tests.test_metrics_rules import needs

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "aisched-rules.yml"
DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "aisched-dashboard.json"


@ai_task(gpus=1, kind="inference", est_seconds=5)
def shard(tag: str) -> int:
    import time as _time

    _time.sleep(1.5)  # long enough that a map wider than the cluster waits in its queue for a few scrapes
    return len(tag)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """Debian's prometheus on 127.0.0.1, scraping the plane every second, with the shipped rules loaded."""

    def __init__(self, folder: Path, plane_url: str) -> None:
        target = plane_url.removeprefix("http://")
        shutil.copy(RULES, folder / "aisched-rules.yml")
        (folder / "prometheus.yml").write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: [aisched-rules.yml]
scrape_configs:
  - job_name: aisched-plane
    metrics_path: /metrics
    static_configs: [{{targets: ["{target}"]}}]
  - job_name: aisched-queue
    metrics_path: /metrics/queue
    static_configs: [{{targets: ["{target}"]}}]
""")
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(folder / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle"],
            cwd=folder, stdout=self.log, stderr=subprocess.STDOUT)
        wait_until(self._ready, 120, "prometheus to be ready")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {Path(self.log.name).read_text()[-2000:]}")
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, promql: str) -> list[dict]:
        got = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=30).json()
        assert got["status"] == "success", got
        return got["data"]["result"]

    def value(self, promql: str) -> float | None:
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@needs(PROMETHEUS, "prometheus")
def test_a_real_prometheus_sees_a_maps_admissions_and_its_queue_depth_fall_to_zero(control_plane, tmp_path):
    assert PROMETHEUS, "prometheus is not installed: apt-get install prometheus"
    t = tenant(control_plane)
    name = t.principal.split("/")[0]
    prom = Prometheus(tmp_path, control_plane.url)
    try:
        up = 'sum(up{job=~"aisched-plane|aisched-queue"})'
        wait_until(lambda: prom.value(up) == 2, 120, "both targets scraped and up")
        admitted = 'sum(aisched_admissions_total{outcome="admitted",phase="record"})'
        before = prom.value(admitted)
        assert before is not None

        tags = [f"arg-{uuid.uuid4().hex}" for _ in range(12)]

        @flow(task_runner=t.runner())
        def wide():
            return [f.result() for f in shard.map(tags)], str(FlowRunContext.get().flow_run.id)

        out, flow_run_id = wide()
        assert out == [len(tag) for tag in tags]

        wait_until(lambda: (prom.value(admitted) or 0) >= before + 12, 120, "the map's 12 admissions in Prometheus")
        depth = f'sum(aisched_queue_waiting{{tenant="{name}"}}) or vector(0)'
        # The map was wider than the cluster's 5 GPUs: its runs waited in the queue while Prometheus scraped.
        peak = prom.value(f'max_over_time((sum(aisched_queue_waiting{{tenant="{name}"}}))[10m:1s])')
        assert peak is not None and peak >= 1, "the queue's depth for this tenant was never seen above zero"
        wait_until(lambda: prom.value(depth) == 0, 60, "the tenant's queue depth back to zero")
        waited = prom.value(f'sum(aisched_queue_wait_seconds_count{{tenant="{name}"}})')
        assert waited is not None and waited >= 12  # every start observed its wait
        assert prom.value('aisched_scheduler_up') == 1
        rules = httpx.get(f"{prom.url}/api/v1/rules", timeout=30).json()["data"]["groups"]
        assert {r["name"] for g in rules for r in g["rules"]} >= {"AISchedPlaneDown", "AISchedBudgetAt80Percent"}

        # Every figure of the dashboard in the docs is a query this Prometheus answers, most with data already.
        import json

        answered = 0
        for panel in json.loads(DASHBOARD.read_text())["panels"]:
            for target in panel["targets"]:
                answered += bool(prom.query(target["expr"]))  # a query Prometheus refuses fails in `query`
        assert answered >= 10, answered

        # No metric carries a task key, a run id, an argument or a token.
        text = httpx.get(f"{control_plane.url}/metrics", timeout=30).text + \
            httpx.get(f"{control_plane.url}/metrics/queue", timeout=30).text
        records = control_plane.records(flow_run_id)
        secrets = {flow_run_id, t.token, *tags, *(r.task_run_id for r in records if r.task_run_id)}
        secrets |= {r.payload["run_key"] for r in records if "run_key" in r.payload}
        leaked = [s for s in secrets if s and s in text]
        assert not leaked, f"metrics carry {leaked}"
        assert "shard" not in text  # not even the task's name
    finally:
        prom.stop()


@needs(PROMTOOL, "promtool")
def test_the_metrics_follow_prometheus_naming_conventions(control_plane):
    assert PROMTOOL, "promtool is not installed: apt-get install prometheus"
    for path in ("/metrics", "/metrics/queue"):
        text = httpx.get(f"{control_plane.url}{path}", timeout=30).text
        done = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{path}: {done.stdout}{done.stderr}"
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                assert line.split()[2].startswith("aisched_"), line
    text = httpx.get(f"{control_plane.url}/metrics", timeout=30).text
    for family in ("aisched_admissions_total", "aisched_denials_total", "aisched_decision_seconds_bucket",
                   "aisched_admission_seconds_bucket", "aisched_ledger_commit_seconds_bucket", "aisched_runs",
                   "aisched_budget_limit", "aisched_budget_held", "aisched_budget_posted", "aisched_approvals_pending",
                   "aisched_approval_oldest_age_seconds", "aisched_evidence_records_total", "aisched_scheduler_up"):
        assert family in text, family
    queue = httpx.get(f"{control_plane.url}/metrics/queue", timeout=30).text
    for family in ("aisched_queue_waiting", "aisched_queue_devices", "aisched_queue_warm_bodies",
                   "aisched_queue_fairness_rho", "aisched_queue_wait_seconds"):
        assert family in queue, family


def _outward_address() -> str | None:
    """An address of this host that is not loopback (where a scrape from another machine would arrive)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: the kernel picks the outward interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


@pytest.mark.slow  # a control plane (and its local cluster) of its own
def test_a_plane_beyond_loopback_refuses_a_scrape_without_the_operators_credential(tmp_path):
    from aisched_prefect.control.process import ControlPlaneProcess

    address = _outward_address()
    if address is None:
        pytest.skip("this host has no address beyond loopback")
    plane = ControlPlaneProcess(tmp_path, declared="1 worker x 1 GPU, 24 GB, A10")
    plane.args += ["--host", "0.0.0.0"]
    plane.start()
    try:
        port = plane.url.rsplit(":", 1)[1]
        for host in (address, "127.0.0.1"):  # listening beyond loopback, even a local scrape shows its credential
            for path in ("/metrics", "/metrics/queue"):
                refused = httpx.get(f"http://{host}:{port}{path}", timeout=30)
                assert refused.status_code == 401, (host, path, refused.status_code)
                assert "aisched_" not in refused.text
                wrong = httpx.get(f"http://{host}:{port}{path}", headers={"authorization": "Bearer nope"}, timeout=30)
                assert wrong.status_code == 401
        flow_token = plane.issue("team-x/flow", tenant="team-x")
        assert httpx.get(f"http://{address}:{port}/metrics", timeout=30,
                         headers={"authorization": f"Bearer {flow_token}"}).status_code == 403  # a flow may not
        ok = httpx.get(f"http://{address}:{port}/metrics", headers={"authorization": f"Bearer {plane.operator_token}"},
                       timeout=30)
        assert ok.status_code == 200 and "aisched_admissions_total" in ok.text
        queue = httpx.get(f"http://{address}:{port}/metrics/queue", timeout=30,
                          headers={"authorization": f"Bearer {plane.operator_token}"})
        assert queue.status_code == 200 and "aisched_queue_devices" in queue.text
    finally:
        plane.stop()
