"""A body's cgroup on a worker of separate processes: past its memory limit it fails with `body-out-of-memory` while
another tenant's body on the same worker completes; a fork bomb ends at its PID limit and leaves no process behind,
with the worker alive; the settlement records the body's peak memory.

The worker is started with small bounds (dask config `dask-gpu.isolation.body-memory-gb`, `body-pids`), as an operator
sets them (`DASK_DASK_GPU__ISOLATION__BODY_MEMORY_GB=...`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prefect import flow
from prefect.context import FlowRunContext

from dask_gpu.isolation.cgroups import cgroups_available
from tests.clusterprocs import single_host
from tests.helpers import authority, tenant
from tests.limits_model import flood, fork_bomb, hog, large, steady, unsealed_handover

pytestmark = [pytest.mark.usefixtures("prefect_api"),
              pytest.mark.skipif(os.geteuid() != 0 or cgroups_available() is not None,
                                 reason=f"needs root and writable cgroups ({cgroups_available()})")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, prefect_api):
    with single_host(tmp_path_factory.mktemp("limits"), env={
        "DASK_DASK_GPU__ISOLATION__BODY_MEMORY_GB": "0.5", "DASK_DASK_GPU__ISOLATION__BODY_PIDS": "48"}) as procs:
        yield procs


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_a_body_past_its_memory_limit_fails_named_while_its_neighbour_completes(cluster):
    a = tenant(cluster.plane)
    b = tenant(cluster.plane, authority_=authority(id="team-b-root", principal="team-b/nightly"),
               principal="team-b/nightly")

    @flow(task_runner=a.runner())
    def greedy():
        state = hog.submit(1024)
        state.wait()
        return state.state, FlowRunContext.get().flow_run.id

    @flow(task_runner=b.runner())
    def modest():
        return hog(64), FlowRunContext.get().flow_run.id

    state, a_run = greedy()
    assert state.is_failed()
    with pytest.raises(RuntimeError, match="body-out-of-memory"):
        state.result()
    got, b_run = modest()
    assert got == 64 * 2**20
    failed = [r.payload for r in cluster.plane.records(a_run) if r.kind == "settlement"]
    assert failed and failed[0]["outcome"] == "failed" and "body-out-of-memory" in failed[0]["error"]
    ok = [r.payload for r in cluster.plane.records(b_run) if r.kind == "settlement"]
    assert ok[0]["outcome"] == "completed" and 64 <= ok[0]["body"]["peak_memory_mb"] < 512


def test_a_result_announced_past_the_bodys_memory_bound_is_refused_unread_and_the_body_ended(cluster):
    """A body streams more than it may hold itself down its result socket: the worker reads none of it (its own memory
    is not the body's to fill), ends the body and fails the run by name; the worker serves the next run."""
    t = tenant(cluster.plane)

    @flow(task_runner=t.runner())
    def flooding():
        state = flood.submit(768)  # 0.75 GiB against a bound of 0.5
        state.wait()
        return state.state, steady(4), FlowRunContext.get().flow_run.id

    state, after, run = flooding()
    assert state.is_failed() and after == 8
    with pytest.raises(Exception, match="MessageTooLarge|refused unread"):
        state.result()
    failed = [r.payload for r in cluster.plane.records(run) if r.kind == "settlement" and r.payload["outcome"] == "failed"]
    assert failed and "more than the 536870912 it may send" in failed[0]["error"], failed


def test_a_result_handed_over_in_a_memory_file_it_did_not_seal_is_refused_and_the_body_ended(cluster):
    """A large result comes as a sealed memory file of the body's, mapped by the worker (not copied through the
    socket); a body that hands over one it did not seal (so it could still change or shrink it) fails by name, is
    ended, and the worker serves the next run, whose 3 MiB result comes back whole the sealed way."""
    t = tenant(cluster.plane)

    @flow(task_runner=t.runner())
    def handing_over():
        state = unsealed_handover.submit(2)
        state.wait()
        return state.state, large(3), FlowRunContext.get().flow_run.id

    state, after, run = handing_over()
    assert state.is_failed() and after == b"r" * (3 * 2**20)
    with pytest.raises(Exception, match="MessageRefused|not sealed"):
        state.result()
    failed = [r.payload for r in cluster.plane.records(run) if r.kind == "settlement" and r.payload["outcome"] == "failed"]
    assert failed and "not sealed" in failed[0]["error"], failed
    done = [r.payload for r in cluster.plane.records(run) if r.kind == "settlement" and r.payload["outcome"] == "completed"]
    assert done and done[0]["result_via"] == "worker" and done[0]["result_bytes"] > 3 * 2**20, done


def test_a_fork_bomb_ends_at_its_pid_limit_and_leaves_nothing_running(cluster, tmp_path):
    t = tenant(cluster.plane)
    pids_file = tmp_path / "bomb-pids"

    @flow(task_runner=t.runner())
    def bomb():
        state = fork_bomb.submit(str(pids_file))
        state.wait()
        return state.state, steady(21)

    state, after = bomb()
    assert state.is_failed()
    from dask_gpu.body.limit_names import LimitReached

    # fork() refused (EAGAIN at the cgroup's pids.max), told by the limit's name with the kernel's error and the fix
    with pytest.raises(LimitReached, match=r"process limit, PIDs.*BlockingIOError.*Fix: .*--body-pids"):
        state.result()
    children = [int(p) for p in pids_file.read_text().split()]
    assert 10 <= len(children) < 48
    assert not any(_alive(p) for p in children)  # killed with the body's cgroup as it ended
    assert after == 42  # the worker is alive and serves the next run
