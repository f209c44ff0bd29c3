"""Attack 8, revocation reaches running work: plain Python and subprocesses, by every way authority ends.

Before: revocation missed a running task when its root grant was deleted or its expiry edited in the block (the
task ran to its end), while the block could not be loaded, and for plain Python that never calls `checkpoint()`:
it ran to its end and its result came back as completed. Now every body runs in a process of its own that the
worker kills (with everything it started) when the control plane's watcher finds its chain broken, or when the
control plane stops renewing its lease.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from aisched_prefect import ai_task
from tests.attacks.support import FlowThread, authority, budget, outcome, root, tenant, uid, wait_for

pytestmark = pytest.mark.usefixtures("prefect_api")
STOP_WITHIN = 5.0


@ai_task(gpus=0.5, gpu_memory_gb=10, gpu_type="H100", kind="training", est_seconds=600)
def python_loop(marker: str) -> str:
    """Plain Python: no checkpoint(), no subprocess, nothing that asks whether it should stop."""
    Path(marker).write_text(f"{os.getpid()}")
    n = 0
    while n >= 0:
        n += 1
        time.sleep(0.01)
    return "finished"


@ai_task(gpus=0.5, gpu_memory_gb=10, gpu_type="H100", kind="training", est_seconds=600)
def subprocess_task(marker: str) -> str:
    """A trainer started with plain subprocess (not run_subprocess): it must die with the body."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(marker).write_text(f"{os.getpid()} {child.pid}")
    child.wait()
    return "finished"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped yet) runs nothing
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def pids(marker: Path) -> list[int]:
    return [int(p) for p in marker.read_text().split()]


def end_authority(plane, t, grant, how: str) -> None:
    """How an operator ends the grant a running task acts under."""
    if how == "revoke":
        assert plane.revoke(grant.id, reason="incident").json() == {"revoked": True}
    elif how == "credential":  # the flow's own credential
        plane.ok("POST", f"/v1/credentials/{t.token.split('_')[1]}/revoke")
    elif how == "delete-root":  # a new version of the authority without the root
        plane.apply("authority", t.authority, authority(root("someone/else")))
    else:  # "expiry": a new version whose root expired a moment ago
        expired = grant.model_copy(update={"expires_at": datetime.now(timezone.utc) - timedelta(seconds=1)})
        plane.apply("authority", t.authority, authority(expired))


def test_ending_authority_in_any_way_stops_running_python_and_subprocesses_within_seconds(control_plane, tmp_path):
    """Seven runs at once: a plain-Python loop and a subprocess task, under a grant that is revoked, deleted from the
    applied authority, or given an expiry in the past, and a loop whose flow's credential is revoked. Each is killed
    within 5 s, ends denied at revocation, and is charged for what ran."""
    cases = {}
    for how in ("revoke", "delete-root", "expiry", "credential"):
        for task in (python_loop, subprocess_task)[: 1 if how == "credential" else 2]:
            grant = root()
            t = tenant(control_plane, grant)
            marker = tmp_path / uid(f"{task.name}-{how}")
            run = FlowThread(t.runner(), lambda task=task, marker=marker: outcome(task, str(marker)),
                             name=uid(f"revoked-{how}"))
            cases[(task.name, how)] = (t, grant, marker, run)

    wait_for(lambda: all(m.exists() and m.read_text().strip() for _, _, m, _ in cases.values()), 90,
             "every body to start")
    ended_at = {}
    for key, (t, grant, _, _) in cases.items():
        ended_at[key] = time.time()
        end_authority(control_plane, t, grant, key[1])

    for key, (t, grant, marker, run) in cases.items():
        wait_for(lambda: not any(alive(p) for p in pids(marker)), ended_at[key] + STOP_WITHIN - time.time(),
                 f"{key} to be killed")
    for key, (t, grant, marker, run) in cases.items():
        out, flow_run_id = run.join(60)
        assert out.startswith("denied: denied at revocation") and "was stopped after" in out, (key, out)
        settlement = control_plane.records(flow_run_id)[-1]
        assert settlement.kind == "settlement" and settlement.payload["outcome"] == "stopped-revoked", key
        assert settlement.ts - ended_at[key] < STOP_WITHIN, (key, settlement.ts - ended_at[key])
        assert settlement.payload["seconds"] > 0 and sum(settlement.payload["charges"].values()) > 0, key


def test_a_control_plane_that_stops_answering_stops_its_bodies_when_their_lease_runs_out(own_plane, tmp_path):
    """Fail closed: the control plane freezes (SIGSTOP: its connections stay open, Dask cancels nothing, it renews no
    lease). Its running bodies die once their 2 s lease runs out. Thawed, it settles them as stopped: the flow never
    gets a result."""
    plane = own_plane(AISCHED_BODY_LEASE_SECONDS="2")
    runs = []
    for task in (python_loop, subprocess_task):
        marker = tmp_path / uid(task.name)
        runs.append((marker, FlowThread(tenant(plane).runner(), lambda task=task, marker=marker: outcome(task, str(marker)))))
    wait_for(lambda: all(m.exists() and m.read_text().strip() for m, _ in runs), 90, "the bodies to start")
    time.sleep(0.5)  # a lease renewal or two while the plane still answers (nothing is meant to stop yet)
    assert all(alive(p) for m, _ in runs for p in pids(m))

    os.kill(plane.proc.pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        for marker, _ in runs:
            wait_for(lambda: not any(alive(p) for p in pids(marker)), frozen_at + STOP_WITHIN - time.monotonic(),
                     f"the body of {marker.name} to be killed after its lease")
    finally:
        os.kill(plane.proc.pid, signal.SIGCONT)
    for _, run in runs:
        run.thread.join(60)
        assert not run.thread.is_alive() and not run.result, run.result
        assert "lease expired" in str(run.error[0]), run.error
    settlements = [r for r in plane.ledger().records() if r.kind == "settlement"]
    assert sorted(r.payload["outcome"] for r in settlements) == ["stopped-lease", "stopped-lease"]


def test_a_root_narrowed_below_a_running_request_stops_it(control_plane, tmp_path):
    """An operator narrows the root (training no longer allowed) while a training run holds it: it stops too."""
    grant = root(kinds=["training", "inference"])
    t = tenant(control_plane, grant)
    marker = tmp_path / uid("narrowed")
    run = FlowThread(t.runner(), lambda: outcome(python_loop, str(marker)))
    wait_for(lambda: marker.exists() and marker.read_text().strip(), 90, "the body to start")
    narrowed_at = time.time()
    control_plane.apply("authority", t.authority, authority(grant.model_copy(update={"kinds": ["inference"]})))
    try:
        wait_for(lambda: not any(alive(p) for p in pids(marker)), narrowed_at + STOP_WITHIN - time.time(),
                 "the training run to be stopped once its grant allows only inference")
    finally:
        control_plane.revoke(grant.id, reason="end the test's run")
        run.join(60)
