"""The tenant boundary on a GPU worker run as root, as a GPU host's worker runs (dask_gpu.isolation).

A scheduler and two `dask-gpu-worker` processes with TLS, as docs/how-to/gpu-cluster.md starts them: `iso` runs as
root with bubblewrap (isolated: the default there), with device nodes that stand in for its two GPUs; `single`
cannot isolate (`--isolation unisolated`) and was started for one tenant. Two tenants' bodies run on `iso` at once:
each under a UID of its own, neither able to read the other's files, the worker's TLS key or local directory, or
see or signal the other's process; each sees only its own GPU node. `single` refuses the second tenant.

Needs root and bwrap: skipped elsewhere with the reason, required under CI (AISCHED_REQUIRE_ISOLATION=1, set by
.ci/run, which installs bubblewrap).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import cloudpickle
import psutil
import pytest

from dask_gpu import GPURequest
from dask_gpu.body.code import code_digest
from dask_gpu.isolation import IsolationSettings, TenantRefused, can_isolate
from dask_gpu.worker.sandbox import Body, run_ticketed
from dask_gpu.tickets import TicketSigner, digest
from tests.clusterprocs import BIN, ClusterProcs
from tests.helpers import wait_until

UIDS = (23000, 23099)
REQUEST = GPURequest(gpus=1, gpu_type="L4")


def _require_isolation() -> None:
    why = can_isolate(IsolationSettings())
    if why is None:
        return
    if os.environ.get("AISCHED_REQUIRE_ISOLATION"):
        pytest.fail(f"AISCHED_REQUIRE_ISOLATION is set but this machine cannot isolate bodies: {why}")
    pytest.skip(f"needs a root worker with bubblewrap: {why} (.ci/run installs it and requires this test)")


def _bodies():
    """Pickled by value (defined in a function), so a body's process need not import this test module."""

    def tenant_a(secret: str) -> dict:
        import os
        import time

        home = os.environ["HOME"]
        with open(os.path.join(home, "secret.txt"), "w") as f:
            f.write(secret)
        with open("/tmp/secret.txt", "w") as f:
            f.write(secret)
        deadline = time.monotonic() + 90
        while not os.path.exists(os.path.join(home, "release")) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the test, as root on the host, drops `release` into this body's directory
        import subprocess
        import sys

        child = subprocess.run([sys.executable, "-c", "import os, json; print(os.getuid())"], capture_output=True,
                               text=True, timeout=60)  # a body starts programs (torchrun) as itself
        return {"uid": os.getuid(), "gid": os.getgid(), "home": home, "pid": os.getpid(),
                "subprocess": child.stdout.strip() or child.stderr[-300:],
                "procs": sorted(p for p in os.listdir("/proc") if p.isdigit()),
                "dev": sorted(d for d in os.listdir("/dev") if d.startswith("nvidia")),
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "env": sorted(os.environ)}

    def tenant_b(paths: list[str], dirs: list[str], other_pid: int) -> dict:
        import os
        import sys

        out: dict = {"uid": os.getuid(), "procs": sorted(p for p in os.listdir("/proc") if p.isdigit()),
                     "reads": {}, "lists": {}, "env": dict(os.environ)}
        for path in paths:
            try:
                with open(path) as f:
                    f.read()
                out["reads"][path] = "read"
            except OSError as exc:
                out["reads"][path] = type(exc).__name__
        for path in dirs:
            try:
                out["lists"][path] = os.listdir(path)
            except OSError as exc:
                out["lists"][path] = type(exc).__name__
        try:
            os.kill(other_pid, 0)
            out["signal"] = "delivered"
        except OSError as exc:
            out["signal"] = type(exc).__name__
        writable = []
        for entry in filter(None, sys.path):
            try:
                with open(os.path.join(entry, "planted_by_b.py"), "w") as f:
                    f.write("OWNED = True\n")
                writable.append(entry)
            except OSError:
                pass
        out["writable_import_path"] = writable
        return out

    def whoami() -> int:
        import os

        return os.getuid()

    def own_node(release: str) -> dict:
        """What of /dev this body sees and can read (its stand-in node is a file), once `release` exists."""
        import os
        import time

        deadline = time.monotonic() + 90
        while not os.path.exists(os.path.join(os.environ["HOME"], "release")) and release and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:
            with open(f"/dev/nvidia{visible}") as f:
                read = f.read()
        except OSError as exc:
            read = type(exc).__name__
        return {"visible": visible, "dev": sorted(d for d in os.listdir("/dev") if d.startswith("nvidia")),
                "read": read}

    def data_user(data: str) -> dict:
        """Reads what its flow wrote on its tenant's shared path and writes beside it."""
        import os

        with open(os.path.join(data, "from-flow.txt")) as f:
            got = f.read()
        with open(os.path.join(data, "from-body.txt"), "w") as f:
            f.write("written by the body")
        return {"got": got, "groups": os.getgroups(), "uid": os.getuid()}

    def reader(path: str) -> str:
        with open(path) as f:
            return f.read()

    def keyring_writer(secret: str) -> dict:
        """Leaves a secret in its UID's user keyring (which outlives every process of the UID, and a UID is leased
        again to another tenant later), and tries to read that keyring back: errno of each call."""
        import ctypes
        import ctypes.util
        import os
        import platform

        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.syscall.restype = ctypes.c_long
        add_key, keyctl = (217, 219) if platform.machine() == "aarch64" else (248, 250)  # system-call numbers
        user_keyring = -4  # KEY_SPEC_USER_KEYRING
        key = libc.syscall(ctypes.c_long(add_key), b"user", b"aisched-left", secret.encode(),
                           ctypes.c_size_t(len(secret)), ctypes.c_int(user_keyring))
        add = [key, ctypes.get_errno()]
        got = libc.syscall(ctypes.c_long(keyctl), ctypes.c_int(0), ctypes.c_int(user_keyring), ctypes.c_int(0))
        return {"add_key": add, "get_keyring_id": [got, ctypes.get_errno()], "uid": os.getuid()}

    def deep_tree(depth: int) -> dict:
        """A working directory `depth` levels deep, and a symlink out of it to a directory it must not lose."""
        import os

        home = os.environ["HOME"]
        os.symlink("/usr", os.path.join(home, "usr-link"))
        os.chdir(home)
        for _ in range(depth):
            os.mkdir("d")
            os.chdir("d")
            with open("f", "w") as f:
                f.write("x")
        os.chdir(home)
        return {"home": home, "depth": depth}

    def prefect_user() -> dict:
        """What every flow's task module does: Prefect, imported by the tenant's zygote as root, then used here."""
        import os

        from prefect.logging.configuration import setup_logging
        from prefect.settings import PREFECT_HOME

        setup_logging()  # reads PREFECT_HOME/logging.yml if it is there
        return {"prefect_home": str(PREFECT_HOME.value()), "home": os.environ["HOME"]}

    def tmp_filler(where: str) -> dict:
        """Writes 16 MiB at a time into `where` until the write fails: how much went in, and why it stopped."""
        import os

        chunk, written = b"x" * (16 << 20), 0
        try:
            with open(os.path.join(where, "fill"), "wb") as f:
                while written < (4 << 30):
                    f.write(chunk)
                    f.flush()
                    written += len(chunk)
        except OSError as exc:
            return {"written": written, "errno": exc.errno}
        return {"written": written, "errno": None}

    return (tenant_a, tenant_b, whoami, own_node, data_user, reader, keyring_writer, deep_tree, prefect_user,
            tmp_filler)


(tenant_a, tenant_b, whoami, own_node, data_user, reader, keyring_writer, deep_tree, prefect_user,
 tmp_filler) = _bodies()
DATA_GID = 23500  # the team's group: owns its shared storage; no user of this host has it
BODY_MEMORY_GB = 1  # each body's memory bound on `iso`: its /tmp and /dev/shm hold half of it each


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    _require_isolation()
    root = tmp_path_factory.mktemp("isolation")
    dev = root / "dev"  # stand-ins for this host's GPU nodes (a test cannot make real ones)
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl"):
        (dev / name).write_text(name)
    data = Path(tempfile.mkdtemp(prefix="aisched-team-d-", dir="/var/tmp"))  # team-d's storage (not under /tmp, whose
    # binds a body's private /tmp keeps read-only)
    os.chown(data, 0, DATA_GID)
    os.chmod(data, 0o2770)  # the team's group reads and writes; nobody else even looks
    procs = ClusterProcs(root, env={"DASK_DASK_GPU__ISOLATION__MODE": "auto",
                                    "DASK_DASK_GPU__ISOLATION__DEVICE_NODES": str(dev),
                                    "DASK_DASK_GPU__ISOLATION__BODY_UIDS": f"{UIDS[0]}-{UIDS[1]}",
                                    "DASK_DASK_GPU__ISOLATION__TENANT_PATHS": f"team-d={data}",
                                    "DASK_DASK_GPU__ISOLATION__TENANT_GROUPS": f"team-d={DATA_GID}",
                                    "DASK_DASK_GPU__ISOLATION__BODY_MEMORY_GB": str(BODY_MEMORY_GB)})
    procs.data = data
    try:
        procs.start_scheduler()
        procs.start_worker("iso", "2 GPUs, 24 GB, L4", nthreads=4)
        procs._spawn("single", [str(BIN / "dask-gpu-worker"), procs.address, "--tls-dir", str(procs.tls),
                                "--trust-key", procs.key, "--declared", "1 GPU, 24 GB, L4", "--name", "single",
                                "--nthreads", "2", "--host", "127.0.0.1", "--no-dashboard",
                                "--isolation", "unisolated", "--tenant", "team-a"])
        procs.wait_for_workers(2)
        yield procs
    finally:
        procs.close()
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture(scope="module")
def signer(cluster) -> TicketSigner:
    from aisched_prefect.control.service import load_or_make_key

    return TicketSigner(load_or_make_key(cluster.home / "control.key"))


def submit(client, signer, tenant: str, fn, *args, worker: str = "iso", key: str | None = None,
           devices: list[str] | None = None, modules: tuple[str, ...] = ()):
    body = Body(payload=cloudpickle.dumps(fn) + cloudpickle.dumps((args, {})), devices=devices, modules=list(modules))
    ticket = signer.issue(run=f"iso-{time.monotonic_ns()}", payload_digest=digest(body.payload),
                          code_digest=code_digest(fn), request=REQUEST, tenant=tenant)
    return client.submit(run_ticketed, ticket, body, workers=[worker], allow_other_workers=False,
                         resources=REQUEST.resources(), pure=False, **({"key": key} if key else {}))


def test_two_tenants_bodies_on_one_root_worker_cannot_reach_each_other_or_the_worker(cluster, signer):
    from dask_gpu.client.cluster import cluster_view, worker_addresses

    with cluster.client() as client:
        views = {v.name: v for v in cluster_view(client)}
        assert views["iso"].isolation == "isolated" and "own UID" in views["iso"].isolation_detail
        assert views["single"].isolation == "unisolated" and "team-a only" in views["single"].isolation_detail
        address = worker_addresses(client)["iso"]
        local = client.run(lambda dask_worker: dask_worker.local_directory, workers=[address])[address]
        worker_pid = cluster.worker_pid(address)
        bodies = Path(local) / "bodies"

        a = submit(client, signer, "team-a", tenant_a, "a's secret")

        def a_started():
            """tenant a's body to write its secret"""
            return next((p.parent for p in bodies.glob("*/secret.txt")), None)

        a_dir = wait_until(a_started)
        a_uid = a_dir.stat().st_uid
        a_pid = next(p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == a_uid)
        tls = cluster.tls
        paths = [f"/run/aisched-bodies/{a_dir.name}/secret.txt", str(a_dir / "secret.txt"),
                 str(tls / "cluster.key"), str(tls / "client.key"), f"/proc/{worker_pid}/environ",
                 f"/proc/{a_pid}/environ", f"/proc/{a_pid}/root/tmp/secret.txt"]
        dirs = [local, str(bodies), "/run/aisched-bodies", str(tls), f"/proc/{a_pid}/cwd"]
        b = submit(client, signer, "team-b", tenant_b, paths, dirs, a_pid).result(timeout=60)
        assert b.ok, b.error_text
        seen_by_b = cloudpickle.loads(b.value)
        (a_dir / "release").write_text("")
        out_a = a.result(timeout=60)
        assert out_a.ok, out_a.error_text
        seen_by_a = cloudpickle.loads(out_a.value)

    # Different identities of their own, never the worker's (root).
    assert seen_by_a["uid"] == a_uid and UIDS[0] <= a_uid <= UIDS[1]
    assert seen_by_a["subprocess"] == str(a_uid)
    assert UIDS[0] <= seen_by_b["uid"] <= UIDS[1] and seen_by_b["uid"] != a_uid
    assert psutil.Process(worker_pid).uids().real == 0
    # Neither the other's files, nor the worker's key, local directory or process.
    assert all(v != "read" for v in seen_by_b["reads"].values()), seen_by_b["reads"]
    assert all(not isinstance(v, list) or not v for v in seen_by_b["lists"].values()), seen_by_b["lists"]
    assert seen_by_b["procs"] == ["1"] and seen_by_a["procs"] == ["1"] and seen_by_a["pid"] == 1
    assert seen_by_b["signal"] == "ProcessLookupError"
    assert seen_by_b["writable_import_path"] == []
    # An environment with nothing of the worker's; only its own GPU node.
    assert set(seen_by_b["env"]) <= {"PATH", "HOME", "TMPDIR", "LANG", "PWD", "PYTHONPATH", "CUDA_DEVICE_ORDER",
                                     "CUDA_VISIBLE_DEVICES", "DASK_GPU_WORKER", "DASK_GPU_WORKER_NAME", "MASTER_ADDR",
                                     "MASTER_PORT",
                                     "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "NNODES",
                                     "NPROC_PER_NODE", "GROUP_RANK", "ROLE_RANK"}, sorted(seen_by_b["env"])
    assert not any("TRUSTED" in k or k.startswith(("DASK_", "AISCHED_")) for k in seen_by_b["env"]
                   if k not in ("DASK_GPU_WORKER", "DASK_GPU_WORKER_NAME"))  # where it runs: the run's own facts
    assert seen_by_a["dev"] == [f"nvidia{seen_by_a['visible']}", "nvidiactl"]
    assert seen_by_a["home"] == "/home/body"
    # Its working directory (and /tmp) went with it.
    wait_until(lambda: not a_dir.exists())


def test_a_worker_that_cannot_isolate_serves_only_the_tenant_it_was_started_for(cluster, signer):
    with cluster.client() as client:
        out = submit(client, signer, "team-a", whoami, worker="single").result(timeout=60)
        assert out.ok and cloudpickle.loads(out.value) == 0  # unisolated: the worker's own user, and it says so
        with pytest.raises(TenantRefused, match="serves tenant 'team-a' only.*--tenant"):
            submit(client, signer, "team-b", whoami, worker="single").result(timeout=60)
    assert "isolation: unisolated" in cluster.log("single")
    assert "isolation: isolated" in cluster.log("iso")


def test_bodies_of_one_tenant_on_different_gpus_each_keep_their_own_node(cluster, signer):
    """Two bodies of one tenant at once on GPUs 0 and 1, then a third on GPU 0: each sees and opens exactly its own
    node. (Each body's /dev was the /dev its tenant's zygote and bodies share, with the other nodes unlinked from it:
    the third body found no node at all.)"""
    from dask_gpu.client.cluster import worker_addresses

    with cluster.client() as client:
        address = worker_addresses(client)["iso"]
        local = client.run(lambda dask_worker: dask_worker.local_directory, workers=[address])[address]
        bodies = Path(local) / "bodies"
        before = set(bodies.iterdir())
        first = submit(client, signer, "team-c", own_node, "wait", devices=["0"])
        second = submit(client, signer, "team-c", own_node, "wait", devices=["1"])
        both = wait_until(lambda: (lambda new: new if len(new) == 2 else None)(set(bodies.iterdir()) - before), 60,
                          "both bodies to start")
        for d in both:
            (d / "release").write_text("")
        seen = [cloudpickle.loads(f.result(timeout=60).value) for f in (first, second)]
        third = cloudpickle.loads(submit(client, signer, "team-c", own_node, "", devices=["0"]).result(timeout=60).value)
    assert seen[0] == {"visible": "0", "dev": ["nvidia0", "nvidiactl"], "read": "nvidia0"}
    assert seen[1] == {"visible": "1", "dev": ["nvidia1", "nvidiactl"], "read": "nvidia1"}
    assert third == {"visible": "0", "dev": ["nvidia0", "nvidiactl"], "read": "nvidia0"}


def test_a_tenants_bodies_reach_its_declared_data_under_its_group_and_nothing_else(cluster, signer):
    """The operator gives team-d its shared storage (dask-gpu-worker --tenant-path team-d=DIR --tenant-group
    team-d=GID): its body, under a UID of its own, reads what its flow wrote there and writes beside it, as a member of
    the team's group; a path it was not given fails naming the path and the setting; another tenant's body does not
    even see team-d's storage."""
    data = cluster.data
    (data / "from-flow.txt").write_text("rows")
    os.chown(data / "from-flow.txt", 0, DATA_GID)
    os.chmod(data / "from-flow.txt", 0o640)
    with cluster.client() as client:
        out = submit(client, signer, "team-d", data_user, str(data)).result(timeout=60)
        assert out.ok, out.error_text
        seen = cloudpickle.loads(out.value)
        other = submit(client, signer, "team-d", reader, "/var/lib/not-given/x.txt").result(timeout=60)
        foreign = submit(client, signer, "team-b", reader, str(data / "from-flow.txt")).result(timeout=60)
    assert seen["got"] == "rows" and seen["groups"] == [DATA_GID] and UIDS[0] <= seen["uid"] <= UIDS[1]
    written = data / "from-body.txt"
    assert written.read_text() == "written by the body" and written.stat().st_gid == DATA_GID
    assert not other.ok and "/var/lib/not-given/x.txt is not among the paths this worker gives tenant team-d" in \
        other.error_message and "--tenant-path team-d=" in other.error_message, other.error_message
    assert not foreign.ok and str(data) in foreign.error_message and "tenant team-b" in foreign.error_message, \
        foreign.error_message


def test_a_body_leaves_nothing_in_its_uids_kernel_keyring_for_a_later_tenant(cluster, signer):
    """The kernel's per-UID user keyring is not namespaced and outlives every process of the UID; UIDs are leased
    again to other tenants. A body on the root worker cannot add a key there or even look the keyring up (EPERM from
    the body's system-call filter), so nothing of one tenant waits in it for the next."""
    import errno

    with cluster.client() as client:
        out = submit(client, signer, "team-k", keyring_writer, "k's secret").result(timeout=60)
    assert out.ok, out.error_text
    seen = cloudpickle.loads(out.value)
    assert UIDS[0] <= seen["uid"] <= UIDS[1]
    assert seen["add_key"] == [-1, errno.EPERM] and seen["get_keyring_id"] == [-1, errno.EPERM], seen


def test_a_3000_deep_working_directory_is_removed_when_its_body_ends(cluster, signer):
    """A body leaves a 3,000-deep tree (past CPython 3.11's recursive rmtree) and a symlink to /usr in its working
    directory: the worker removes all of it without following the link, and says nothing of a RecursionError."""
    from dask_gpu.client.cluster import worker_addresses

    with cluster.client() as client:
        address = worker_addresses(client)["iso"]
        local = client.run(lambda dask_worker: dask_worker.local_directory, workers=[address])[address]
        bodies = Path(local) / "bodies"
        before = set(bodies.iterdir())
        out = submit(client, signer, "team-e", deep_tree, 3000).result(timeout=120)
        assert out.ok, out.error_text
    assert cloudpickle.loads(out.value) == {"home": "/home/body", "depth": 3000}
    wait_until(lambda: not (set(bodies.iterdir()) - before), 60, "the deep working directory to be removed")
    assert os.path.isdir("/usr/bin") and "RecursionError" not in cluster.log("iso")


def test_a_package_the_zygote_imported_as_root_works_in_the_body_under_its_own_home(cluster, signer):
    """A flow's task module imports Prefect; the tenant's zygote imports it (an installed package) as root before
    forking the body. Prefect keeps PREFECT_HOME from the environment it was imported in: the zygote's is the body's
    (HOME=/home/body), not root's home, which a body cannot read (every example flow failed on isolated workers with
    PermissionError on /root/.prefect/logging.yml)."""
    with cluster.client() as client:
        out = submit(client, signer, "team-f", prefect_user, modules=("prefect",)).result(timeout=120)
    assert out.ok, out.error_text
    assert cloudpickle.loads(out.value) == {"prefect_home": "/home/body/.prefect", "home": "/home/body"}


@pytest.mark.parametrize("where", ["/tmp", "/dev/shm"])
def test_a_bodys_tmp_and_shm_are_full_at_half_its_memory_bound_and_the_body_lives_to_say_so(cluster, signer, where):
    """A body filling its private /tmp (or /dev/shm) gets ENOSPC at half its memory bound, not the kernel's default
    of half the host's memory, and not the OOM killer: its run returns and says how far it got."""
    import errno

    with cluster.client() as client:
        out = submit(client, signer, "team-g", tmp_filler, where).result(timeout=120)
    assert out.ok, out.error_text
    seen = cloudpickle.loads(out.value)
    half = BODY_MEMORY_GB * 2**30 // 2
    assert seen["errno"] == errno.ENOSPC and half - (16 << 20) <= seen["written"] <= half, seen
