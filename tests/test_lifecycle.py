"""A run's life is state, not a held thread: waiting runs cost a queue entry and a row, on both sides of the plane.

The session's cluster has one A10: runs asking for it wait in the cluster's queue behind each other, which is the
shape of a big `.map()` on a busy cluster.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from prefect import flow

from aisched_prefect import AISchedTaskRunner, ai_task
from tests.helpers import CuttingProxy, tenant, wait_until

pytestmark = pytest.mark.usefixtures("prefect_api")

WAITING = 40


@ai_task(gpus=1, gpu_type="A10", kind="inference", est_seconds=60)
def gated(i: int, flag: str) -> int:
    deadline = time.time() + 120
    while not os.path.exists(flag) and time.time() < deadline:
        time.sleep(0.05)
    return i * 3


def _queue(plane) -> dict:
    return plane.ok("GET", "/v1/queue")


def test_waiting_runs_hold_no_thread_on_either_side(control_plane, tmp_path):
    """WAITING runs wait in the queue behind one that holds the A10: neither the flow process nor the control plane
    grows a thread per waiting run (each grows by a handful at most), and every run then completes once."""
    t = tenant(control_plane)
    flag = str(tmp_path / "go")
    plane = psutil.Process(control_plane.proc.pid)
    before_plane, before_flow = plane.num_threads(), threading.active_count()
    out: dict = {}

    @flow(task_runner=t.runner())
    def fan_out() -> list[int]:
        return [f.result() for f in gated.map(range(WAITING + 1), flag=flag)]

    runner = threading.Thread(target=lambda: out.setdefault("result", fan_out()))
    runner.start()
    try:
        wait_until(lambda: _queue(control_plane)["queued"] >= WAITING, 120,
                   what=f"{WAITING} runs waiting in the queue")
        during_plane, during_flow = plane.num_threads(), threading.active_count()
    finally:
        Path(flag).touch()
        runner.join(timeout=300)
    assert out["result"] == [i * 3 for i in range(WAITING + 1)]
    # A thread per waiting run would add WAITING to each side; the plane follows one running run with one thread.
    assert during_plane - before_plane <= 12, (before_plane, during_plane)
    assert during_flow - before_flow <= 12, (before_flow, during_flow)
    status = _queue(control_plane)
    assert status["queued"] == 0 and status["running"] == 0


FLOW_SCRIPT = textwrap.dedent('''
    import os, sys, time
    from prefect import flow
    from prefect.context import FlowRunContext
    from aisched_prefect import AISchedTaskRunner, ai_task

    GATE = sys.argv[4]  # read here: the body runs on a worker, whose argv is its own

    @ai_task(gpus=1, gpu_type="A10", kind="inference", est_seconds=30)
    def held(i):  # until the test opens the gate
        deadline = time.time() + 120
        while not os.path.exists(GATE) and time.time() < deadline:
            time.sleep(0.05)
        return i

    @flow(task_runner=AISchedTaskRunner(control_plane=sys.argv[1], credential=sys.argv[2]))
    def doomed(n):
        print(FlowRunContext.get().flow_run.id, flush=True)
        return [f.result() for f in held.map(range(n))]

    doomed(int(sys.argv[3]))
''')


@pytest.mark.slow  # a flow process killed with runs waiting: about a minute
def test_a_flow_process_killed_with_runs_waiting_leaves_the_queue_and_each_run_is_charged_once(control_plane,
                                                                                                 tmp_path):
    """kill -9 of the flow process while one run holds the A10 and the others wait: once its session lapses the
    waiting runs leave the queue with nothing charged while the running one still runs (none of them starts for
    nobody), the running one finishes and is settled, and every admission has exactly one settlement."""
    n = 12
    t = tenant(control_plane)
    script, gate = tmp_path / "doomed.py", tmp_path / "gate"
    script.write_text(FLOW_SCRIPT)
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_LOGGING_LEVEL": "ERROR",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script), control_plane.url, t.token, str(n), str(gate)],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        flow_run_id = proc.stdout.readline().strip()
        wait_until(lambda: (q := _queue(control_plane))["queued"] == n - 1 and q["running"] == 1, 120,
                   what="one run on the A10 and the others waiting in the queue")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    try:  # the lease runs from the end of the dead process's last poll (its wait, at most 20 s, after it died)
        wait_until(lambda: (q := _queue(control_plane))["queued"] == 0 and q["running"] == 1, 120,
                   what="the waiting runs out of the queue while the running one still runs")
    finally:
        gate.touch()

    def settled():
        records = control_plane.records(flow_run_id)
        admitted = [r for r in records if r.kind == "admission"]
        ended = [r for r in records if r.kind == "settlement"]
        return (admitted, ended) if len(admitted) == n and len(ended) == n else None

    admitted, ended = wait_until(settled, 180, what="every run settled after its flow process died")
    assert len({r.task_run_id for r in ended}) == n  # one settlement per run
    outcomes = [r.payload["outcome"] for r in ended]
    assert sorted(outcomes) == ["abandoned-while-queued"] * (n - 1) + ["completed"], outcomes
    for r in ended:
        if r.payload["outcome"] == "abandoned-while-queued":
            assert all(s.get("charged", 0) == 0 for s in r.payload.get("settlements", [])), r.payload
    assert wait_until(lambda: _queue(control_plane)["queued"] == 0 and _queue(control_plane)["running"] == 0 or None,
                      120, what="the queue empty")


@ai_task(gpus=1, gpu_type="A10", kind="inference", est_seconds=30)
def quick(i: int) -> int:
    time.sleep(0.3)
    return i + 1


def test_connections_cut_while_runs_wait_lose_none_and_run_none_twice(control_plane):
    """Every connection between the flow and the plane is cut, again and again, while runs wait and run: the flow
    sends its requests again (idempotent by key) and re-polls from its last acknowledged outcome, so every run
    completes once, with one admission and one settlement."""
    n = 30
    t = tenant(control_plane)
    proxy = CuttingProxy(control_plane.url)
    ids: list[str] = []
    out: dict = {}

    @flow(task_runner=AISchedTaskRunner(control_plane=proxy.url, credential=t.token))
    def through_a_flaky_network() -> list[int]:
        from prefect.context import FlowRunContext

        ids.append(str(FlowRunContext.get().flow_run.id))
        return [f.result() for f in quick.map(range(n))]

    runner = threading.Thread(target=lambda: out.setdefault("result", through_a_flaky_network()))
    runner.start()
    try:
        while runner.is_alive() and proxy.cuts < 6:
            time.sleep(1.0)
            proxy.cut()
        runner.join(timeout=300)
    finally:
        proxy.close()
    assert out["result"] == [i + 1 for i in range(n)]
    assert proxy.cuts >= 2
    records = control_plane.records(ids[0])
    per_run: dict[str, list[str]] = {}
    for r in records:
        per_run.setdefault(r.task_run_id, []).append(r.kind)
    assert len(per_run) == n
    # once each (the map's first shard holds as it is admitted, the others once as the queue starts them)
    assert sorted(k for k in per_run.values() if "shard-hold" not in k) == [["admission", "settlement"]], per_run
    assert all(k == ["admission", "shard-hold", "settlement"] for k in per_run.values() if "shard-hold" in k), per_run
