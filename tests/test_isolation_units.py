"""The pure parts of the tenant boundary on a worker: modes, the tenant gate, UIDs, the sandbox's arguments."""

from __future__ import annotations

import os

import pytest

from dask_gpu.isolation import (IsolationError, IsolationPlan, IsolationSettings, TenantGate, TenantRefused, plan_for)
from dask_gpu.isolation import devices, filesystem
from dask_gpu.isolation.identity import UidPool
from dask_gpu.tickets import Ticket, TicketSigner
from dask_gpu.worker.zygote import installed


def test_settings_name_the_field_and_the_fix():
    assert IsolationSettings(body_uids="30000-30009").body_uids == (30000, 30009)
    for bad in ("0-10", "20-x", "300-200"):
        with pytest.raises(ValueError, match="body_uids"):
            IsolationSettings(body_uids=bad)


def test_a_worker_that_cannot_isolate_says_why_and_isolated_is_never_a_silent_downgrade(tmp_path):
    missing = IsolationSettings(bwrap=str(tmp_path / "no-bwrap"), tenant="team-a")
    plan = plan_for(missing)
    assert plan.mode == "unisolated" and "bubblewrap is not installed" in plan.why
    assert "serves tenant team-a only" in plan.describe()
    with pytest.raises(IsolationError, match="Fix: run the worker as root with bubblewrap"):
        plan_for(missing.model_copy(update={"mode": "isolated"}))
    assert plan_for(IsolationSettings(mode="shared")).mode == "shared"


def test_an_unisolated_worker_has_its_one_tenant_fixed_at_start(tmp_path):
    """No tenant learned from the first body (a nanny's restart would forget it): without --tenant it does not start."""
    fallback = IsolationSettings(bwrap=str(tmp_path / "no-bwrap"))  # auto, on a host that cannot isolate
    for settings, said in ((fallback, "cannot isolate bodies (bubblewrap is not installed"),
                           (IsolationSettings(mode="unisolated"), "--isolation unisolated serves one tenant")):
        with pytest.raises(IsolationError) as refused:
            plan_for(settings)
        message = str(refused.value)
        assert said in message and "Fix: start it for that tenant (--tenant NAME" in message and "\n" not in message
    assert plan_for(IsolationSettings(mode="unisolated", tenant="team-a")).settings.tenant == "team-a"


def test_an_unisolated_worker_serves_one_tenant():
    started_for = TenantGate(IsolationPlan(mode="unisolated", why="not root", settings=IsolationSettings(tenant="t")))
    started_for.admit("t", "r0")
    with pytest.raises(TenantRefused, match="serves tenant 't' only, because it was started for that tenant"):
        started_for.admit("team-a", "r1")
    nobody = TenantGate(IsolationPlan(mode="unisolated", why="not root"))  # a plan made without plan_for's check
    for tenant in ("team-a", "team-a", ""):
        with pytest.raises(TenantRefused, match="started for no tenant.*--tenant NAME"):
            nobody.admit(tenant, "r")
    assert "serves no tenant" in nobody.plan.describe()
    isolated = TenantGate(IsolationPlan(mode="isolated"))
    for tenant in ("team-a", "team-b", ""):
        isolated.admit(tenant, "r")
    TenantGate(IsolationPlan(mode="shared")).admit("anyone", "r")


def test_uids_come_back_only_after_the_range_turned_over():
    pool = UidPool(100000, 100002)
    first = pool.lease()
    pool.release(first)
    assert [pool.lease(), pool.lease(), pool.lease()] == [100001, 100002, 100000]
    with pytest.raises(IsolationError, match="wider range"):
        pool.lease()


def test_two_workers_of_one_host_never_lease_the_same_uid_at_once(tmp_path):
    """Workers of one host share the default range: a UID another worker's body holds is skipped."""
    a, b = UidPool(100000, 100002, locks=str(tmp_path)), UidPool(100000, 100002, locks=str(tmp_path))
    held_a = [a.lease(), a.lease()]
    assert b.lease() not in held_a
    with pytest.raises(IsolationError, match="this host's workers"):
        b.lease()
    a.release(held_a[0])
    assert b.lease() == held_a[0]


def test_a_dead_workers_uids_come_free(tmp_path):
    import subprocess
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from dask_gpu.isolation.identity import UidPool; "
         f"p = UidPool(100000, 100001, locks={str(tmp_path)!r}); print(p.lease(), p.lease(), flush=True); "
         "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert sorted(map(int, holder.stdout.readline().split())) == [100000, 100001]
        pool = UidPool(100000, 100001, locks=str(tmp_path))
        with pytest.raises(IsolationError):
            pool.lease()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert sorted([pool.lease(), pool.lease()]) == [100000, 100001]


def test_the_ticket_names_its_tenant_and_old_tickets_still_parse():
    signer = TicketSigner.generate()
    from dask_gpu import GPURequest

    t = signer.issue(run="r", payload_digest="a", code_digest="b", request=GPURequest(gpus=1), tenant="team-a")
    assert t.tenant == "team-a"
    old = t.model_dump(mode="json")
    del old["tenant"]
    assert Ticket.model_validate(old).tenant == ""


def test_the_sandbox_binds_code_read_only_and_covers_the_workers_secrets_under_it(tmp_path):
    code = tmp_path / "code"
    (code / "tls").mkdir(parents=True)
    (code / "tls" / "cluster.key").write_text("k")
    (code / "scratch").mkdir()
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidia7", "nvidiactl"):
        (dev / name).write_text("")
    args = filesystem.sandbox_argv("/usr/bin/bwrap", read_only=[str(code)], bodies_dir=str(tmp_path / "bodies"),
                                   hide=[str(code / "tls" / "cluster.key"), str(code / "scratch"), "/elsewhere/x"],
                                   devices=devices.sandbox_nodes(str(dev), [0, 1]))
    pairs = list(zip(args, args[1:], args[2:]))
    assert ("--ro-bind", str(code), str(code)) in pairs
    assert ("--ro-bind", "/dev/null", str(code / "tls" / "cluster.key")) in pairs
    assert args[args.index(str(code / "scratch")) - 1] == "--tmpfs"
    assert args.index(str(code / "scratch")) > args.index(str(code))  # covered after it is bound
    assert ("--dev-bind", str(dev / "nvidia1"), "/dev/nvidia1") in pairs
    assert str(dev / "nvidia7") not in args  # not this worker's GPU
    assert "/elsewhere/x" not in args  # not reachable in the sandbox anyway
    assert "--bind" in args and args[args.index("--bind") + 2] == filesystem.BODIES
    assert not any(a.startswith("--unshare-net") for a in args)  # gangs meet over the host's network


def test_the_body_environment_has_nothing_of_the_workers(monkeypatch):
    monkeypatch.setenv("AISCHED_TOKEN", "secret")
    env = filesystem.body_env({"CUDA_VISIBLE_DEVICES": "1"}, ["/nonexistent", os.getcwd()])
    assert "AISCHED_TOKEN" not in env and env["CUDA_VISIBLE_DEVICES"] == "1" and env["HOME"] == filesystem.HOME
    assert "/nonexistent" not in env["PYTHONPATH"]


def test_an_isolated_zygote_imports_as_root_only_installed_packages_and_the_workers_own():
    assert installed("json") and installed("cloudpickle") and installed("dask_gpu.worker.sandbox")
    assert not installed("tests.test_isolation_units")  # a flow's own module: its body imports it, unprivileged
    assert not installed("no_such_module_anywhere")


def test_auto_does_not_pick_a_sandbox_this_host_cannot_make(tmp_path):
    """A root worker in a container that forbids namespaces: bwrap is there but fails, so `auto` runs unisolated."""
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    plan = plan_for(IsolationSettings(bwrap=str(fake), tenant="team-a"))
    assert plan.mode == "unisolated"
    if os.geteuid() == 0:
        assert "cannot make a sandbox on this host: bwrap: No permissions" in plan.why


def test_the_examples_in_the_filesystem_docstrings_hold():
    import doctest

    assert doctest.testmod(filesystem).failed == 0
