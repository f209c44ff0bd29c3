"""Warm bodies under the same authority and books as runs (issue 39, the plane's side), on a cluster of separate
processes: a credential's expiry ends an idle body and stops a running run; a plane killed (SIGKILL) and started
again knows its idle bodies from the ledger's rows, so a revocation still reaches them and each idle period is
settled once, for what it idled; a worker killed with only idle bodies settles their idle time to its death; an
idle settlement rides out a Postgres outage as a run's settlement does; and a second authority block for the same
principal name gets a cold body, never the first block's warm one.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from prefect import flow
from prefect.context import FlowRunContext

from aisched_prefect import Ledger, ai_task
from tests.clusterprocs import ClusterProcs, kill_worker_process, single_host
from tests.controlplane import ControlPlaneProcess
from tests.helpers import authority, budget, tenant, wait_until
from tests.warm_model import score

pytestmark = pytest.mark.usefixtures("prefect_api")
# Idle for minutes unless something ends it (not the map's tail: control.dispatch.warm_tail ends those when its flow run
# has nothing of the key left).
LONG = score.with_options(keep_warm=600, keep_warm_across_flow_runs=True)


@ai_task(gpus=0.5, kind="batch-inference", est_seconds=60, keep_warm=0)
def hold_until(gate: str, marks: str) -> int:
    """A run that goes on until the test opens its gate (two minutes at most)."""
    Path(marks).write_text("started")
    deadline = time.monotonic() + 120
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
    return os.getpid()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, prefect_api):
    # Sessions outlive each test's flow: its bodies end by what the test does, not because its flow process left.
    with single_host(tmp_path_factory.mktemp("warm-authority"), env={
            "AISCHED_MAX_KEEP_WARM_SECONDS": "3600", "AISCHED_SESSION_LEASE_SECONDS": "900"}) as procs:
        yield procs


def _one_warm(cluster: ClusterProcs, t, log: Path) -> tuple[dict, str]:
    """One run that leaves its body idle for minutes: its body, and the flow run."""
    @flow(task_runner=t.runner())
    def one():
        return LONG(1, str(log)), FlowRunContext.get().flow_run.id

    _, flow_run_id = one()
    (body,) = [r.payload["body"] for r in t.plane.records(flow_run_id) if r.kind == "settlement"]
    assert body["kept"], repr([(r.kind, r.payload) for r in t.plane.records(flow_run_id)])[-3000:]
    wait_until(lambda: any(b["id"] == body["id"] for b in cluster.warm_bodies()), 60, "the body to wait warm")
    return body, str(flow_run_id)


def _idle_records(plane: ControlPlaneProcess, flow_run_id: str) -> list:
    return [r for r in plane.records(flow_run_id) if r.kind == "warm-idle"]


def _row(plane: ControlPlaneProcess, body: str) -> dict | None:
    from aisched_prefect.ledger.schema import warm_bodies

    with plane.ledger().reader.connect() as conn:
        r = conn.execute(sa.select(warm_bodies).where(warm_bodies.c.body == body)).first()
    return None if r is None else dict(r._mapping)


def _tenant(cluster: ClusterProcs, **kw):
    return tenant(cluster.plane, **kw)


def test_a_credentials_expiry_ends_its_idle_body_and_stops_its_running_run(cluster, tmp_path):
    cluster.end_warm_bodies()
    plane = cluster.plane
    t = _tenant(cluster)
    expires_in = 25.0
    token = plane.issue(t.principal, authority=t.authority, budget=t.budget, tenant=t.principal.split("/")[0],
                        expires_in=expires_in)
    issued = time.monotonic()
    t.token = token
    gate, marks = tmp_path / "gate", tmp_path / "marks"
    ids: list[str] = []

    @flow(task_runner=t.runner())
    def both():
        ids.append(str(FlowRunContext.get().flow_run.id))
        LONG(1, str(tmp_path / "log"))  # its body waits idle, warm for 10 minutes
        return hold_until(str(gate), str(marks))  # runs until the test opens the gate

    runner = threading.Thread(target=lambda: _swallow(both), daemon=True)
    runner.start()
    wait_until(marks.exists, 120, "the second run to be running")
    assert len(cluster.warm_bodies()) == 1 and time.monotonic() - issued < expires_in, "too slow to test the expiry"
    # Past the expiry: the idle body ends and the running run is stopped, by the watcher, within seconds.
    wait_until(lambda: not cluster.warm_bodies(), expires_in + 30, "the idle body of the expired credential to end")
    ended = time.monotonic() - issued

    def stopped() -> list:
        return [r for r in plane.records(ids[0]) if r.kind == "settlement" and r.payload.get("outcome") ==
                "stopped-revoked"]

    stop = wait_until(stopped, 30, "the running run of the expired credential to be stopped")
    stopped_after = time.monotonic() - issued
    gate.touch()
    idle = wait_until(lambda: _idle_records(plane, ids[0]), 30, "the idle time to be settled")
    assert len(idle) == 1 and "expired" in idle[0].payload["ended"], idle[0].payload
    assert len(stop) == 1
    assert expires_in <= ended < expires_in + 15 and stopped_after < expires_in + 15
    print(f"expiry at {expires_in:.0f}s: idle body ended at {ended:.1f}s, running run stopped by {stopped_after:.1f}s")


def _swallow(f) -> None:
    try:
        f()
    except BaseException:  # the flow's credential expired under it: what it says is not what this test checks
        pass


def test_a_second_authority_block_for_the_same_principal_gets_a_cold_body(cluster, tmp_path):
    cluster.end_warm_bodies()
    first = _tenant(cluster, authority_=authority(principal="team-s/same"), principal="team-s/same")
    # The same principal name, the same grant id, under another authority block.
    second = _tenant(cluster, authority_=authority(principal="team-s/same"), principal="team-s/same")
    assert first.authority != second.authority
    body, _ = _one_warm(cluster, first, tmp_path / "a")

    @flow(task_runner=second.runner())
    def again():
        return LONG(2, str(tmp_path / "b")), FlowRunContext.get().flow_run.id

    _, flow_run_id = again()
    (other,) = [r.payload["body"] for r in cluster.plane.records(flow_run_id) if r.kind == "settlement"]
    assert other["start"] == "cold" and other["id"] != body["id"], (body, other)


def test_revocation_reaches_an_idle_body_after_the_plane_was_killed_and_started_again(cluster, tmp_path):
    cluster.end_warm_bodies()
    t = _tenant(cluster, authority_=authority(id="restart-root"))
    body, flow_run_id = _one_warm(cluster, t, tmp_path / "loads")  # its row is written before its run's reply
    plane = cluster.plane
    port = plane.url.rsplit(":", 1)[1]
    plane.kill()  # SIGKILL: nothing of its memory survives
    plane.args[plane.args.index("--port") + 1] = port
    plane.start()
    assert len(cluster.warm_bodies()) == 1  # the body waits on, as the worker keeps it
    t0 = time.monotonic()
    assert plane.revoke("restart-root", reason="incident").json() == {"revoked": True}
    wait_until(lambda: not cluster.warm_bodies(), 30, "the revoked principal's idle body to end after the restart")
    ended_after = time.monotonic() - t0
    idle = wait_until(lambda: _idle_records(plane, flow_run_id), 30, "its idle time to be settled")
    time.sleep(1.0)  # a second settlement, were there one, would be recorded by now (the end event came once)
    idle = _idle_records(plane, flow_run_id)
    assert len(idle) == 1 and idle[0].payload["ended"].startswith("its authority ended"), idle[0].payload
    assert idle[0].payload["seconds"] < 300  # what it idled, not the 600 s keep-warm time
    holds = [r for r in plane.records(flow_run_id) if r.kind == "warm-hold"]
    (account,) = [a for a in plane.ledger().accounts() if a["budget"] == t.budget]
    assert len(holds) == 1 and account["pending"] == 0
    row = _row(plane, body["id"])
    assert row["state"] == "ended" and row["runs"] == body["runs"] and row["ended_why"].startswith("its authority")
    print(f"idle body ended {ended_after:.2f}s after a revocation at the restarted plane")


def test_an_idle_settlement_rides_out_a_postgres_outage(cluster, tmp_path, postgres_url):
    from tests.helpers import CuttingProxy

    cluster.end_warm_bodies()
    host_port = postgres_url.split("@", 1)[1].split("/", 1)[0]
    proxy = CuttingProxy(host_port)
    proxied = postgres_url.replace(host_port, proxy.url.removeprefix("http://"), 1)
    home = tmp_path / "pg-plane"
    home.mkdir()
    shutil.copy(cluster.home / "control.key", home / "control.key")  # the key the workers trust
    plane = ControlPlaneProcess(home, dask_address=cluster.address, dask_tls=cluster.tls,
                                env={"AISCHED_LEDGER_URL": proxied, "AISCHED_SESSION_LEASE_SECONDS": "900",
                                     "AISCHED_MAX_KEEP_WARM_SECONDS": "3600"}).start()
    try:
        t = tenant(plane)
        body, flow_run_id = _one_warm(cluster, t, tmp_path / "loads")
        proxy.down(4.0)  # Postgres restarts: connections dropped, new ones refused, for 4 s ...
        with cluster.client() as client:  # ... while the body ends (its worker reports its idle time)
            client.sync(client.scheduler.broadcast, msg={"op": "gpu_end_warm", "bodies": [body["id"]]})
        auditor = Ledger(postgres_url)  # read past the proxy: the plane's way to it is what is down
        try:
            idle = wait_until(lambda: [r for r in auditor.records(flow_run_id) if r.kind == "warm-idle"], 60,
                              "the idle time to be settled after the outage")
            assert len(idle) == 1 and idle[0].payload["seconds"] < 300
            (account,) = [a for a in auditor.accounts() if a["budget"] == t.budget]
            assert account["pending"] == 0 and account["posted"] > 0  # settled by what it idled, not left to expire
        finally:
            auditor.close()
    finally:
        plane.stop()
        proxy.close()


def test_a_worker_killed_with_only_idle_bodies_settles_their_idle_time_to_its_death(cluster, tmp_path):
    cluster.end_warm_bodies()
    t = _tenant(cluster)
    body, flow_run_id = _one_warm(cluster, t, tmp_path / "loads")
    with cluster.client() as client:
        (address,) = list(client.scheduler_info()["workers"])
    time.sleep(2.0)  # it idles a little before its worker dies
    killed = time.time()
    kill_worker_process(cluster.worker_pid(address))  # nothing runs on it: only the idle body
    idle = wait_until(lambda: _idle_records(cluster.plane, flow_run_id), 60, "the idle time to be settled")
    assert len(idle) == 1 and "left" in idle[0].payload["ended"], idle[0].payload
    idle_since = _row(cluster.plane, body["id"])["idle_since"]
    assert idle[0].payload["seconds"] <= killed - idle_since + 10  # to its death, not the 600 s keep-warm time
    (account,) = [a for a in cluster.plane.ledger().accounts() if a["budget"] == t.budget]
    assert account["pending"] == 0
    cluster.wait_for_workers(1, timeout=120)  # its nanny started it again


def test_a_body_that_ended_while_the_plane_was_down_is_settled_by_what_it_idled(cluster, tmp_path):
    """The plane is killed; the body ends on its worker meanwhile (its end event goes nowhere); the plane started
    again reconciles its rows with the worker's report and settles the idle period by the seconds the worker
    measured, not the 600 s keep-warm time its hold covers."""
    cluster.end_warm_bodies()
    t = _tenant(cluster)
    body, flow_run_id = _one_warm(cluster, t, tmp_path / "loads")
    plane = cluster.plane
    port = plane.url.rsplit(":", 1)[1]
    plane.kill()
    with cluster.client() as client:
        client.sync(client.scheduler.broadcast, msg={"op": "gpu_end_warm", "bodies": [body["id"]]})
    wait_until(lambda: not cluster.warm_bodies(), 30, "the body to end while the plane is down")
    down_for = 5.0
    time.sleep(down_for)  # the plane stays down a while: its idle time must not count this
    plane.args[plane.args.index("--port") + 1] = port
    plane.start()
    restarted = time.time()
    idle = wait_until(lambda: _idle_records(plane, flow_run_id), 60, "the idle time to be settled by the new plane")
    assert len(idle) == 1 and idle[0].payload["ended"] == "ended by the control plane", idle[0].payload
    row = _row(plane, body["id"])
    assert row["state"] == "ended" and idle[0].payload["seconds"] < restarted - row["idle_since"] - down_for
    assert row["ended_at"] == pytest.approx(row["idle_since"] + idle[0].payload["seconds"], abs=0.01)
    (account,) = [a for a in plane.ledger().accounts() if a["budget"] == t.budget]
    assert account["pending"] == 0


def test_a_budget_cut_below_what_it_holds_ends_an_idle_body(cluster, tmp_path):
    cluster.end_warm_bodies()
    t = _tenant(cluster)
    body, flow_run_id = _one_warm(cluster, t, tmp_path / "loads")  # its idle hold: 600 s of a quarter H100, 0.17
    cluster.plane.apply("budget", t.budget, budget(limit=0.05))  # an operator cuts the budget below that
    wait_until(lambda: not cluster.warm_bodies(), 30, "the idle body of the cut budget to end")
    idle = wait_until(lambda: _idle_records(cluster.plane, flow_run_id), 30, "its idle time to be settled")
    assert len(idle) == 1 and f"budget {t.budget!r} was cut to 0.05" in idle[0].payload["ended"], idle[0].payload
