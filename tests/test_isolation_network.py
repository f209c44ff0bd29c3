"""Each body on a root worker has a network namespace of its own (dask_gpu.isolation.network).

Before: bodies shared the host's namespace, so an idle body of tenant A could list and write into tenant B's
abstract unix socket and loopback listener (B's MASTER_PORT). Now, on a real `dask-gpu-worker` run as root with
bubblewrap (as tests/test_isolation.py starts them), tenant B's body cannot reach either, outbound is what the
operator configured (`pasta`: the host's outside, never its loopback; `none`: nothing), and a two-member gang on
two isolated workers still meets at its MASTER_PORT.

Needs root, bwrap and pasta: skipped elsewhere with the reason, required under CI (AISCHED_REQUIRE_ISOLATION=1).
"""

from __future__ import annotations

import errno
import json
import socket
import time

import cloudpickle
import pytest

from dask_gpu import GPURequest
from dask_gpu.body.code import code_digest
from dask_gpu.isolation import IsolationError, IsolationSettings, plan_for
from dask_gpu.worker.sandbox import Body, run_ticketed
from dask_gpu.tickets import TicketSigner, digest
from tests.clusterprocs import ClusterProcs
from tests.helpers import wait_until
from tests.test_isolation import _require_isolation

UIDS = (23100, 23199)
REQUEST = GPURequest(gpus=1, gpu_type="L4")


def _bodies():
    """Pickled by value (defined in a function), so a body's process need not import this test module."""

    def listener(name: str) -> dict:
        """Listens on an abstract unix socket and on its rendezvous (MASTER_ADDR:MASTER_PORT, 127.0.0.1 for a run on
        one host, as torchrun's store would), says where (a file in its home), and returns what anybody sent to
        either until `release` appears in its home."""
        import json
        import os
        import socket
        import time

        home = os.environ["HOME"]
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind("\0" + name)
        unix.listen(4)
        tcp = socket.create_server((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))  # its rendezvous
        for s in (unix, tcp):
            s.settimeout(0.05)
        with open(os.path.join(home, "listening.tmp"), "w") as f:
            json.dump({"port": tcp.getsockname()[1]}, f)
        os.rename(os.path.join(home, "listening.tmp"), os.path.join(home, "listening"))
        got: list[str] = []
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(home, "release")) and time.monotonic() < deadline:
            for s in (unix, tcp):
                try:
                    conn, _ = s.accept()
                except OSError:
                    continue
                conn.settimeout(5)
                got.append(conn.recv(100).decode(errors="replace"))
                conn.close()
        return {"got": got, "port": tcp.getsockname()[1]}

    def intruder(name: str, port: int) -> dict:
        """Tries what tenant A's idle body did: find B's abstract socket, connect to it and to B's port, write."""
        import socket

        out: dict = {}
        with open("/proc/net/unix") as f:
            out["listed"] = ("@" + name) in f.read()
        for what, family, address in (("unix", socket.AF_UNIX, "\0" + name),
                                      ("tcp", socket.AF_INET, ("127.0.0.1", port))):
            s = socket.socket(family, socket.SOCK_STREAM)
            s.settimeout(10)
            try:
                s.connect(address)
                s.sendall(b"written by another tenant")
                out[what] = "connected"
            except OSError as exc:
                out[what] = exc.errno
            finally:
                s.close()
        return out

    def prober(targets: list) -> dict:
        """Connects to each (host, port): 'connected', or the errno; and names its interfaces."""
        import os
        import socket

        out: dict = {"interfaces": sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []}
        with open("/proc/net/dev") as f:
            out["interfaces"] = sorted(line.split(":")[0].strip() for line in f.readlines()[2:])
        for host, port in targets:
            try:
                socket.create_connection((host, port), timeout=5).close()
                out[f"{host}:{port}"] = "connected"
            except OSError as exc:
                out[f"{host}:{port}"] = exc.errno if exc.errno is not None else type(exc).__name__
        return out

    def meet() -> dict:
        """A gang member: rank 0 listens at MASTER_ADDR:MASTER_PORT, rank 1 connects and says its rank."""
        import os
        import socket
        import time

        rank, addr, port = int(os.environ["RANK"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if rank == 0:
            with socket.create_server((addr, port)) as server:
                server.settimeout(90)
                conn, _ = server.accept()
                said = conn.makefile().readline().strip()
                conn.sendall(b"welcome\n")
                conn.close()
            return {"rank": 0, "heard": said}
        deadline = time.monotonic() + 90
        while True:
            try:
                conn = socket.create_connection((addr, port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        conn.sendall(b"rank 1\n")
        answer = conn.makefile().readline().strip()
        conn.close()
        return {"rank": 1, "heard": answer}

    return listener, intruder, prober, meet


listener, intruder, prober, meet = _bodies()


def _require_pasta() -> None:
    import shutil

    _require_isolation()
    why = None if shutil.which("pasta") else "pasta is not installed (Debian: apt-get install passt)"
    if why:
        import os

        if os.environ.get("AISCHED_REQUIRE_ISOLATION"):
            pytest.fail(f"AISCHED_REQUIRE_ISOLATION is set but {why}")
        pytest.skip(f"needs pasta: {why}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """`iso`: isolated, outbound through pasta (the default); `quiet`: isolated, `--network none`."""
    _require_pasta()
    root = tmp_path_factory.mktemp("isolation-network")
    dev = root / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl"):
        (dev / name).write_text(name)
    procs = ClusterProcs(root, env={"DASK_DASK_GPU__ISOLATION__MODE": "isolated",
                                    "DASK_DASK_GPU__ISOLATION__DEVICE_NODES": str(dev),
                                    "DASK_DASK_GPU__ISOLATION__BODY_UIDS": f"{UIDS[0]}-{UIDS[1]}",
                                    "DASK_DASK_GPU__ISOLATION__BODY_MEMORY_GB": "1"})
    try:
        procs.start_scheduler()
        procs.start_worker("iso", "2 GPUs, 24 GB, L4", nthreads=4)
        shared_env = procs.env
        procs.env = {**shared_env, "DASK_DASK_GPU__ISOLATION__NETWORK": "none"}  # the dask.config way
        procs.start_worker("quiet", "1 GPU, 24 GB, L4")
        procs.env = shared_env
        procs.wait_for_workers(2)
        yield procs
    finally:
        procs.close()


@pytest.fixture(scope="module")
def signer(cluster) -> TicketSigner:
    from aisched_prefect.control.service import load_or_make_key

    return TicketSigner(load_or_make_key(cluster.home / "control.key"))


def submit(client, signer, tenant: str, fn, *args, worker: str = "iso", request: GPURequest = REQUEST,
           member: int = 0, ticket=None):
    body = Body(payload=cloudpickle.dumps(fn) + cloudpickle.dumps((args, {})), member=member)
    ticket = ticket or signer.issue(run=f"net-{time.monotonic_ns()}", payload_digest=digest(body.payload),
                                    code_digest=code_digest(fn), request=request, tenant=tenant)
    return client.submit(run_ticketed, ticket, body, workers=[worker], allow_other_workers=False,
                         resources=ticket.member_request(member).resources(), pure=False)


def _value(future):
    out = future.result(timeout=120)
    assert out.ok, out.error_text or out.error_message
    return cloudpickle.loads(out.value)


def test_a_tenants_body_cannot_reach_another_tenants_abstract_socket_or_loopback_listener(cluster, signer):
    from pathlib import Path

    from dask_gpu.client.cluster import cluster_view, worker_addresses

    name = f"aisched-b-{time.monotonic_ns()}"
    with cluster.client() as client:
        views = {v.name: v for v in cluster_view(client)}
        address = worker_addresses(client)["iso"]
        local = client.run(lambda dask_worker: dask_worker.local_directory, workers=[address])[address]
        b = submit(client, signer, "team-b", listener, name)
        ready = wait_until(lambda: next(iter(Path(local, "bodies").glob("*/listening")), None), timeout=120)
        port = json.loads(ready.read_text())["port"]
        try:
            seen = _value(submit(client, signer, "team-a", intruder, name, port))
        finally:
            (ready.parent / "release").write_text("")
        heard = _value(b)

    assert heard["port"] == port
    assert seen["listed"] is False, seen  # not even in A's /proc/net/unix
    assert seen["unix"] == errno.ECONNREFUSED and seen["tcp"] == errno.ECONNREFUSED, seen
    assert heard["got"] == [], heard  # nothing of A's reached B
    assert "network namespace of its own (outbound through pasta" in views["iso"].isolation_detail


def _gateway() -> str | None:
    """The host's default gateway (IPv4), from /proc/net/route."""
    with open("/proc/net/route") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[1] == "00000000" and int(fields[3], 16) & 2:
                return socket.inet_ntoa(bytes.fromhex(fields[2])[::-1])
    return None


def _outside() -> list | None:
    """Something outside this host that the host itself reaches now: its first DNS server over TCP (None: none)."""
    try:
        with open("/etc/resolv.conf") as f:
            servers = [line.split()[1] for line in f if line.startswith("nameserver") and len(line.split()) > 1]
    except OSError:
        return None
    for server in servers:
        if ":" in server or server.startswith("127."):
            continue
        try:
            socket.create_connection((server, 53), timeout=5).close()
            return [server, 53]
        except OSError:
            continue
    return None


def test_outbound_is_as_configured_and_never_the_hosts_loopback(cluster, signer):
    """`pasta`: the body reaches what the host reaches outside (its DNS server, over TCP), and its traffic leaves
    (to the gateway); `none`: nothing outside (ENETUNREACH). Neither reaches a listener on the host's loopback."""
    gateway, outside = _gateway(), _outside()
    with socket.create_server(("127.0.0.1", 0)) as host_listener:
        targets = [["127.0.0.1", host_listener.getsockname()[1]]] + ([[gateway, 9]] if gateway else []) + \
            ([outside] if outside else [])
        with cluster.client() as client:
            outbound = _value(submit(client, signer, "team-a", prober, targets))
            closed = _value(submit(client, signer, "team-a", prober, targets, worker="quiet"))
    loopback = f"127.0.0.1:{targets[0][1]}"
    assert outbound[loopback] == errno.ECONNREFUSED and closed[loopback] == errno.ECONNREFUSED, (outbound, closed)
    assert closed["interfaces"] == ["lo"], closed
    assert len(outbound["interfaces"]) == 2 and "lo" in outbound["interfaces"], outbound
    if gateway:
        assert closed[f"{gateway}:9"] == errno.ENETUNREACH, closed
        assert outbound[f"{gateway}:9"] != errno.ENETUNREACH, outbound  # routed out (pasta: refused or timed out)
    if outside:
        assert outbound[f"{outside[0]}:53"] == "connected", outbound
        assert closed[f"{outside[0]}:53"] == errno.ENETUNREACH, closed


def test_a_two_member_gang_meets_across_isolated_workers(cluster, signer):
    from dask_gpu.client.cluster import worker_addresses

    request = GPURequest(gpus=2, hosts=2, gpu_type="L4")
    body = Body(payload=cloudpickle.dumps(meet) + cloudpickle.dumps(((), {})))
    with cluster.client() as client:
        where = worker_addresses(client)
        workers = (where["iso"], where["quiet"])
        ticket = signer.issue(run=f"gang-{time.monotonic_ns()}", payload_digest=digest(body.payload),
                              code_digest=code_digest(meet), request=request, tenant="team-g", hosts=2,
                              shares=(1, 1), workers=workers)
        futures = [submit(client, signer, "team-g", meet, worker=name, member=m, ticket=ticket)
                   for m, name in enumerate(("iso", "quiet"))]
        got = [_value(f) for f in futures]
    assert got == [{"rank": 0, "heard": "rank 1"}, {"rank": 1, "heard": "welcome"}]


def test_the_network_a_body_gets_and_a_worker_that_cannot_give_it():
    import dask

    from dask_gpu.isolation import settings_from_config
    from dask_gpu.isolation.network import for_body

    with dask.config.set({"dask-gpu.isolation.network": None}):  # what DASK_DASK_GPU__ISOLATION__NETWORK=none reads as
        assert settings_from_config().network == "none"
    assert for_body("pasta", 1) == "pasta" and for_body("none", 1) == "none"
    assert for_body("pasta", 2) == "host"  # a multi-host gang's member: NCCL's own ports between its members
    with pytest.raises(ValueError, match="network"):
        IsolationSettings(network="slirp")
    _require_isolation()
    with pytest.raises(IsolationError, match="pasta is not installed.*Fix: install it, or choose --network none"):
        plan_for(IsolationSettings(mode="isolated", pasta="/nonexistent/pasta"))
    assert plan_for(IsolationSettings(mode="isolated", network="none", pasta="/nonexistent/pasta")).mode == "isolated"
