"""Multi-host jobs: one admission, whole workers all at once, one process per host meeting over TCP at MASTER_ADDR.

The session cluster has two 2 x H100 workers and one A10 worker (separate processes): `gpus=4, hosts=2,
gpu_type="H100"` runs on both H100 workers, two GPUs each. Without `hosts` a request wider than every worker is
refused, naming the `hosts=` that would hold it: a body written for one process never runs twice unasked.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from types import SimpleNamespace

import pytest
from prefect import flow
from prefect.context import FlowRunContext

from aisched_prefect import ai_task
from tests.helpers import tenant

pytestmark = pytest.mark.usefixtures("prefect_api")


def meet_over_tcp() -> list[dict]:
    """Every member: rank 0 listens at MASTER_ADDR:MASTER_PORT, the others connect and say who they are; all
    agree on the table of ranks rank 0 sends back (what a torch.distributed store does, with plain sockets)."""
    import json
    import socket

    from dask_gpu import current_worker

    env = os.environ
    me = {k.lower(): env[k] for k in ("RANK", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "NPROC_PER_NODE",
                                      "CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT")}
    me.update(worker=current_worker(), pid=os.getpid())
    rank, world, addr, port = int(env["RANK"]), int(env["WORLD_SIZE"]), env["MASTER_ADDR"], int(env["MASTER_PORT"])
    if rank == 0:
        with socket.create_server((addr, port)) as server:
            server.settimeout(60)
            peers, conns = [me], []
            for _ in range(world - 1):
                conn, _ = server.accept()
                peers.append(json.loads(conn.makefile().readline()))
                conns.append(conn)
            table = sorted(peers, key=lambda p: int(p["rank"]))
            for conn in conns:
                conn.sendall((json.dumps(table) + "\n").encode())
                conn.close()
        return table
    deadline = time.time() + 60
    while True:
        try:
            conn = socket.create_connection((addr, port), timeout=5)
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        conn.sendall((json.dumps(me) + "\n").encode())
        table = json.loads(conn.makefile().readline())
    assert table[rank]["pid"] == me["pid"]  # rank 0's table says what this member said
    return table


@ai_task(gpus=4, hosts=2, gpu_type="H100", kind="training", est_seconds=30)
def wide_training():
    return meet_over_tcp()


@ai_task(gpus=2, hosts=2, gpu_type="H100", kind="training", est_seconds=30)
def two_hosts_one_gpu_each():
    return meet_over_tcp()


FAKE_TORCHRUN = """#!{python}
import json, os, sys
print(json.dumps({{"argv": sys.argv[1:], "cvd": os.environ["CUDA_VISIBLE_DEVICES"]}}))
"""


@ai_task(gpus=4, hosts=2, gpu_type="H100", kind="training", est_seconds=30)
def torchrun_job(torchrun: str):
    """The docs' example: one torchrun per host, with the rendezvous the worker set (a stand-in torchrun here)."""
    import json

    from dask_gpu import run_subprocess, torchrun_args

    meet_over_tcp()  # both members are up: member 0 returns what its torchrun saw
    out = run_subprocess(torchrun_args("train.py", "--epochs", "3", torchrun=torchrun), capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def flow_run_records(plane, flow_run_id):
    return [r for r in plane.records(flow_run_id)]


def test_a_two_host_job_runs_on_two_workers_that_meet_over_tcp(control_plane):
    t = tenant(control_plane)

    @flow(task_runner=t.runner())
    def nightly():
        return wide_training(), FlowRunContext.get().flow_run.id

    t0 = time.perf_counter()
    table, flow_run_id = nightly()
    took = time.perf_counter() - t0
    # Two processes on two workers met at MASTER_ADDR:MASTER_PORT and agree on ranks 0 and 1.
    assert [(m["rank"], m["node_rank"], m["local_rank"], m["world_size"]) for m in table] == \
        [("0", "0", "0", "2"), ("1", "1", "0", "2")]
    assert len({m["worker"] for m in table}) == 2 and len({m["pid"] for m in table}) == 2
    assert all(m["cuda_visible_devices"] == "0,1" and m["nproc_per_node"] == "2" for m in table)
    assert len({(m["master_addr"], m["master_port"]) for m in table}) == 1
    # One admission, one hold, one settlement naming every member.
    records = flow_run_records(control_plane, flow_run_id)
    assert [r.kind for r in records] == ["admission", "settlement"], [r.kind for r in records]
    admission, settlement = records
    assert len(admission.payload["holds"]) == len(settlement.payload["settlements"])
    placement = settlement.payload["placement"]
    assert settlement.payload["outcome"] == "completed"
    assert sorted(placement["workers"]) == sorted(m["worker"] for m in table)
    assert [(m["member"], len(m["devices"]), m["ok"]) for m in placement["members"]] == [(0, 2, True), (1, 2, True)]
    assert len(placement["devices"]) == 4 and placement["gpu_type"] == "H100"
    # Charged for 4 GPUs for as long as the longest member ran, at the H100 price, within the hold.
    charged = settlement.payload["settlements"][0]["charged"]
    assert charged == pytest.approx(4 * settlement.payload["seconds"] / 3600 * 4.0, abs=1e-6)
    assert 0 < charged <= admission.payload["holds"][0]["reserved"]
    assert took < 60
    from aisched_prefect import evidence_rows

    (row,) = evidence_rows(records)
    assert row["decision"] == "completed" and row["devices"].count("/") == 4


def test_hosts_spreads_a_job_over_that_many_workers_and_torchrun_gets_its_arguments(control_plane, tmp_path):
    t = tenant(control_plane)
    fake = tmp_path / "torchrun"
    fake.write_text(FAKE_TORCHRUN.format(python=sys.executable))
    fake.chmod(0o755)

    @flow(task_runner=t.runner())
    def nightly():
        return two_hosts_one_gpu_each(), torchrun_job(str(fake))

    table, seen = nightly()
    assert [(m["rank"], m["nproc_per_node"], len(m["cuda_visible_devices"].split(","))) for m in table] == \
        [("0", "1", 1), ("1", "1", 1)]
    assert len({m["worker"] for m in table}) == 2
    master = [a for a in seen["argv"] if a.startswith("--master-")]
    assert seen["argv"][:3] == ["--nnodes=2", "--node-rank=0", "--nproc-per-node=2"] and len(master) == 2
    assert seen["argv"][-3:] == ["train.py", "--epochs", "3"] and seen["cvd"] == "0,1"


@ai_task(gpus=4, hosts=2, gpu_type="H100", kind="training", est_seconds=120)
def one_member_fails():
    rank = int(os.environ["RANK"])
    if rank == 1:
        time.sleep(1.0)
        raise RuntimeError(f"rank {rank} ran out of memory")
    time.sleep(120)  # member 0 would go on for two minutes: it is stopped when member 1 fails
    return "finished"


def test_one_member_failing_stops_the_others_and_the_run_is_settled_once(control_plane):
    t = tenant(control_plane)

    @flow(task_runner=t.runner())
    def nightly():
        try:
            one_member_fails()
        except RuntimeError as exc:
            return str(exc), FlowRunContext.get().flow_run.id
        raise AssertionError("the gang completed")

    t0 = time.perf_counter()
    message, flow_run_id = nightly()
    assert time.perf_counter() - t0 < 40  # not the two minutes member 0 would have slept
    assert "rank 1 ran out of memory" in message
    records = flow_run_records(control_plane, flow_run_id)
    assert [r.kind for r in records] == ["admission", "settlement"]
    settlement = records[1].payload
    assert settlement["outcome"] == "failed" and "member 1" in settlement["error"]
    members = {m["member"]: m for m in settlement["placement"]["members"]}
    assert members[1]["ok"] is False and members[1]["stopped"] is None
    assert members[0]["stopped"] == "stop requested" and members[0]["seconds"] < 30
    (account,) = [a for a in control_plane.ledger().accounts() if a["budget"] == t.budget]
    assert account["pending"] == 0


def test_a_gang_that_cannot_fit_or_was_not_asked_for_is_denied_at_once_naming_what_it_needs(control_plane):
    from aisched_prefect import AdmissionDenied

    @ai_task(gpus=6, gpu_type="H100", kind="training", est_seconds=30)
    def too_wide():
        return 1

    @ai_task(gpus=3, hosts=3, gpu_type="H100", kind="training", est_seconds=30)
    def three_hosts():
        return 1

    @ai_task(gpus=4, gpu_type="H100", kind="training", est_seconds=30)
    def unasked():  # wider than every worker, written for one process: not run as two
        return 1

    t = tenant(control_plane, authority_=__import__("tests.helpers", fromlist=["authority"]).authority(max_gpus=8))

    @flow(task_runner=t.runner())
    def f():
        out = []
        for task in (too_wide, three_hosts, unasked):
            try:
                task()
            except AdmissionDenied as exc:
                out.append((exc.stage, str(exc)))
        return out

    (s1, m1), (s2, m2), (s3, m3) = f()
    assert s1 == s2 == s3 == "feasibility"
    assert "fits no worker" in m1 and "gpu-worker-" in m1
    assert "it needs 3 workers with 1 fitting GPUs each" in m2
    assert "did not ask for several hosts" in m3 and "Fix: ask for hosts=2 (gpus=4, hosts=2" in m3, m3


def test_the_queue_places_a_fixed_width_gang_on_the_smallest_workers_that_hold_its_share():
    from dask_gpu.scheduler.queue import GPUQueuePlugin
    from dask_gpu.sim.policies import ClusterState, FairShare, Job, gang_fit, reservation

    job = Job(0, "a", 8, 0.0, 60.0, width=2)
    assert gang_fit(job, [8, 4, 4, 4], [8, 4, 4, 4]) == ((1, 4), (2, 4))
    assert gang_fit(Job(0, "a", 10, 0.0, 60.0, width=2), [8, 4, 4, 8], [8, 4, 4, 8]) == ((0, 8), (3, 8))
    assert gang_fit(job, [8, 3, 4, 4], [8, 4, 4, 4]) == ((2, 4), (3, 4))
    assert reservation(job, 0.0, ClusterState(free=[4, 4], size=[4, 4])) == (0.0, {0: 0, 1: 0})

    class Scheduler:
        def __init__(self) -> None:
            self.workers = {a: SimpleNamespace(resources={"GPU": 2}, name=a) for a in ("w0", "w1", "w2")}
            self.handlers: dict = {}

    async def scenario():
        plugin = GPUQueuePlugin(FairShare(headroom=0))
        await plugin.start(Scheduler())
        one = await plugin.place("one", tenant="a", gpus=1, estimate=60.0)
        assert one["workers"] == ["w0"] and one["devices"] is None  # devices unknown here: the worker chooses
        spread = await plugin.place("spread", tenant="b", gpus=2, estimate=60.0, width=2)
        assert sorted(spread["workers"]) == ["w1", "w2"] and spread["shares"] == [1, 1]

    asyncio.run(scenario())


def test_with_the_queue_off_a_gang_is_placed_on_whole_idle_workers(tmp_path, plane_home, gpu_cluster):
    """`aisched serve --no-queue`: no queue plugin decides, so the control plane itself waits for enough whole idle
    workers (one gang at a time) and places the members there."""
    import shutil

    from tests.controlplane import ControlPlaneProcess

    home = tmp_path / "no-queue"
    home.mkdir()
    shutil.copy(plane_home / "control.key", home / "control.key")  # the key the session's workers trust
    plane = ControlPlaneProcess(home, dask_address=gpu_cluster.scheduler_address, dask_tls=plane_home / "tls",
                                queue=False).start()
    try:
        t = tenant(plane)

        @flow(task_runner=t.runner())
        def nightly():
            return wide_training(), FlowRunContext.get().flow_run.id

        table, flow_run_id = nightly()
        assert [m["rank"] for m in table] == ["0", "1"] and len({m["worker"] for m in table}) == 2
        (settlement,) = [r for r in plane.records(flow_run_id) if r.kind == "settlement"]
        assert settlement.payload["outcome"] == "completed" and len(settlement.payload["placement"]["members"]) == 2
    finally:
        plane.stop()
