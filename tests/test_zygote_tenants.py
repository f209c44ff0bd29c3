"""Nothing one tenant's body does reaches another tenant's body through the zygote (dask_gpu.worker.zygote).

Before: one zygote per worker, importing every module any body named, behind a unix socket whose path was in its
command line: tenant A's body had it import a module A wrote, and every later fork (tenant B's too) inherited what
that module's code did. Now each tenant has a zygote of its own, reached only over a socket pair its worker holds,
and an isolated zygote imports a flow's own modules not at all (its body imports them, unprivileged).
"""

from __future__ import annotations

import json
import os
import tempfile

import cloudpickle
import psutil
import pytest

from dask_gpu.body.code import code_digest
from dask_gpu.inventory import WorkerInventory
from dask_gpu.isolation import IsolationPlan, IsolationSettings, can_isolate, devices, filesystem
from dask_gpu.worker.plugin import GPUWorkerPlugin
from dask_gpu.framing import recv_msg, send_msg
from dask_gpu.worker.zygote import Zygote


def _bodies():
    def poisoned():  # pickled by value: the child need not import this test module
        import builtins

        return getattr(builtins, "AISCHED_POISONED_BY", None)

    return poisoned


poisoned = _bodies()


def run_body(zygote: Zygote, fn, modules=(), run=None):
    sock = zygote.connect(list(modules), run or {})
    try:
        json.loads(recv_msg(sock))
        send_msg(sock, json.dumps({"env": {}, "code_digest": code_digest(fn), "devices": []}).encode())
        send_msg(sock, cloudpickle.dumps(fn) + cloudpickle.dumps(((), {})))
        meta, blob = json.loads(recv_msg(sock)), recv_msg(sock)
    finally:
        sock.close()
    assert meta["ok"], meta
    return cloudpickle.loads(blob)


def isolated_zygote(tenant: str) -> Zygote:
    """A tenant's zygote in the bwrap sandbox an isolated worker gives it (skipped, or failed under CI, where the
    machine cannot isolate)."""
    why = can_isolate(IsolationSettings())
    if why:
        if os.environ.get("AISCHED_REQUIRE_ISOLATION"):
            pytest.fail(f"AISCHED_REQUIRE_ISOLATION is set but: {why}")
        pytest.skip(f"needs root and bubblewrap: {why}")
    bodies = tempfile.mkdtemp(prefix="zygote-bodies-")
    os.chmod(bodies, 0o711)
    return Zygote(tenant=tenant, sandbox=filesystem.sandbox_argv(
        "/usr/bin/bwrap", read_only=filesystem.code_paths(__import__("sys").path), hide=[], bodies_dir=bodies,
        devices=devices.sandbox_nodes("/dev", [])))


def test_module_level_code_one_tenant_had_imported_never_reaches_another_tenants_bodies():
    plugin = GPUWorkerPlugin(WorkerInventory(), isolation=IsolationPlan(mode="shared"))
    a, b = plugin.zygote_for("team-a"), plugin.zygote_for("team-b")
    try:
        assert a is not b and plugin.zygote_for("team-a") is a
        assert run_body(a, poisoned, ["tests.zygote_poison"]) == "team-a"  # this zygote imported it
        assert run_body(a, poisoned) == "team-a"  # and keeps it, for its own tenant's later bodies
        assert run_body(b, poisoned) is None  # never the other tenant's
        for zygote in (a, b):  # no socket path to find or connect to: only the worker's socket pair
            proc = psutil.Process(zygote._proc.pid)
            assert all(not c.laddr and not c.raddr for c in proc.net_connections(kind="unix")), proc.net_connections("unix")
            assert not any(".sock" in part for part in proc.cmdline())
    finally:
        plugin.teardown(None)


def test_an_isolated_zygote_leaves_a_flows_own_modules_to_its_bodies():
    zygote = isolated_zygote("team-a")
    try:
        first = run_body(zygote, poisoned, ["tests.zygote_poison"], {"uid": 24000, "workdir": "z1"})
        assert first == "team-a"  # its own body imported it, after dropping to UID 24000
        assert run_body(zygote, poisoned, [], {"uid": 24001, "workdir": "z2"}) is None  # the zygote never did
    finally:
        zygote.close()


def test_an_isolated_zygote_outlives_the_thread_that_started_it():
    """A body's Dask thread starts its tenant's zygote and ends with its task. bwrap's --die-with-parent fires when
    the thread that forked it ends: a zygote started there was SIGKILLed, and the bodies queued in it failed."""
    import threading

    zygote = isolated_zygote("team-a")
    try:
        got: list = []
        first = threading.Thread(target=lambda: got.append(run_body(zygote, poisoned, [], {"uid": 24010, "workdir": "t1"})))
        first.start()
        first.join()  # the thread that started the zygote is gone
        started = zygote._proc
        assert got == [None]
        assert run_body(zygote, poisoned, [], {"uid": 24011, "workdir": "t2"}) is None
        assert zygote._proc is started and started.poll() is None  # the same zygote, never killed and restarted
    finally:
        zygote.close()
