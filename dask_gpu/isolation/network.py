"""A body's own network namespace: a loopback of its own, and outbound access only as the operator configures.

Why: abstract unix sockets and loopback listeners belong to a network namespace, not to a UID or a mount
namespace. Bodies that shared the host's namespace could list (/proc/net/unix, /proc/net/tcp) and connect to
another tenant's abstract socket, its local model server or its rendezvous port (MASTER_PORT). So each body of an
isolated worker gets a namespace of its own (`CLONE_NEWNET`, made by the body's own process before it forks the
body: dask_gpu.body.child.run_isolated), with its loopback up; `dask-gpu.isolation.network` says what else it gets:

- `pasta` (the default): outbound TCP, UDP and ICMP through pasta (Debian's `passt` package, the namespace mode of
  passt: what rootless Podman uses), which the worker attaches to the body's namespace before the body reads a byte
  of its run. The body reaches what the worker's host reaches (model hubs, object stores, package indexes), under
  the host's own address, as a Slurm job or a Kubernetes pod does by default. No port is forwarded either way
  (`-t none -u none -T none -U none`) and the gateway is not mapped to the host (`--no-map-gw`): nothing listening on
  the host's loopback (the worker, a scheduler, a local database) is reachable, and the host's own address is the
  body's own (a connection to it stays in the body's namespace).
- `none`: the loopback only; every outbound connection fails (ENETUNREACH). For hosts whose bodies must reach
  nothing (data staged on the tenant's paths).
- `host`: the host's namespace, as before (a trusted team's cluster; logged and advertised as such).

Why pasta and not slirp4netns or a veth per tenant: a veth needs addresses, routes and NAT or a bridge on the host
(firewall rules the operator keeps per tenant) and makes the host's own services reachable unless filtered; pasta
needs nothing configured on the host, maps the namespace's traffic onto ordinary host sockets (the host's firewall
and routing apply unchanged), keeps the host's loopback out by construction, and is faster than slirp4netns (no
TCP/IP stack of its own in user space; Podman 5 replaced slirp4netns with it). It runs as one process per body,
sandboxed by itself, and exits when the body's namespace is released.

Multi-host gangs (`hosts=N`) are the exception: a member's body keeps the host's namespace, because NCCL and gloo
open ports of their own between members besides MASTER_PORT, which no per-port forwarding carries. A gang holds whole
workers, so no other body of that worker runs beside it; every other body on the host has a namespace of its own,
so the gang member cannot reach theirs, nor they its ports. What does not hold: a gang member reaches what the
host's namespace holds (host loopback services, another worker's gang member on the same host), and its rendezvous
port is reachable from other hosts' networks, as any host service is (a firewall between hosts is the operator's).
A run on one host (`hosts=1`, with any number of GPUs) meets at 127.0.0.1 in its own namespace: private.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import shutil
import socket
import struct
import subprocess
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger("distributed.dask_gpu")

Network = Literal["pasta", "none", "host"]
NETWORKS = ("pasta", "none", "host")
CLONE_NEWNET = 0x40000000
MNT_DETACH = 2
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
PASTA_ARGS = ("--config-net", "--no-map-gw", "--quiet", "--runas", "0", "-t", "none", "-u", "none", "-T", "none",
              "-U", "none")
PASTA_START_SECONDS = 30.0


def for_body(network: str, hosts: int) -> str:
    """The namespace a body gets: a multi-host gang's member keeps the host's (its members meet on ports NCCL picks).

    >>> for_body("pasta", 1), for_body("none", 1), for_body("pasta", 2), for_body("host", 1)
    ('pasta', 'none', 'host', 'host')
    """
    return "host" if network == "host" or hosts > 1 else network


def unavailable(network: str, pasta: str) -> str | None:
    """Why this host cannot give bodies the network the operator chose (None: it can)."""
    if network != "pasta":
        return None
    found = pasta if os.path.isfile(pasta) else shutil.which(pasta)
    if not found or not os.access(found, os.X_OK):
        return f"pasta is not installed at {pasta} (Debian: apt-get install passt)"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing (pasta needs the tun module: modprobe tun)"
    return None


def loopback_up() -> None:
    """Bring up `lo` in this process's (fresh) network namespace: a namespace starts with it down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH14x", b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def enter_own() -> None:
    """This process (root, the body's about to be) moves into a network namespace of its own, loopback up."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")
    loopback_up()


@dataclass
class Outbound:
    """The pasta process serving one body's namespace, and the file that holds the namespace for it."""

    path: str
    pid: int | None

    def close(self) -> None:
        """Release the namespace (pasta exits once it is gone) and end pasta if it still runs."""
        libc = ctypes.CDLL(None, use_errno=True)
        libc.umount2(self.path.encode(), MNT_DETACH)
        for leftover in (self.path, self.path + ".pid"):
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass
        if self.pid and _is_pasta_for(self.pid, self.path):
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass


def _is_pasta_for(pid: int, path: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return bool(argv) and os.path.basename(argv[0]) == b"pasta" and path.encode() in argv


def attach(pid: int, name: str, netns_dir: str, pasta: str) -> Outbound:
    """Give the namespace of process `pid` (a body, not yet running its run) outbound access through pasta.

    pasta (this version) cannot open /proc/PID/ns/net once it has sandboxed itself: the namespace is bound to a file
    of this worker's (as `ip netns add` does), which also keeps it until the body ends, and pasta exits when the file
    goes. Returns once pasta has configured the namespace (it forks to the background when ready)."""
    folder = os.path.join(netns_dir, str(os.getpid()))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, name)
    open(path, "w").close()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(f"/proc/{pid}/ns/net".encode(), path.encode(), None, 4096, None) != 0:  # MS_BIND
        err = ctypes.get_errno()
        os.unlink(path)
        raise OSError(err, f"binding the network namespace of body process {pid}: {os.strerror(err)}")
    handle = Outbound(path=path, pid=None)
    try:
        out = subprocess.run([pasta, *PASTA_ARGS, "-P", path + ".pid", "--netns", path], capture_output=True,
                             text=True, timeout=PASTA_START_SECONDS, stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            raise OSError(f"pasta could not serve the body's network namespace (exit {out.returncode}): "
                          f"{out.stderr.strip()[-300:]}")
        with open(path + ".pid") as f:
            handle.pid = int(f.read().strip())
    except BaseException:
        handle.close()
        raise
    return handle


def sweep_stale(netns_dir: str) -> int:
    """Release the namespaces a dead worker left bound (its bodies' pasta processes then exit); how many."""
    released = 0
    try:
        folders = os.listdir(netns_dir)
    except OSError:
        return 0
    for folder in folders:
        if not folder.isdigit() or os.path.exists(f"/proc/{folder}"):
            continue
        where = os.path.join(netns_dir, folder)
        for name in os.listdir(where):
            if not name.endswith(".pid"):
                pid = None
                try:
                    with open(os.path.join(where, name + ".pid")) as f:
                        pid = int(f.read().strip())
                except (OSError, ValueError):
                    pass
                Outbound(os.path.join(where, name), pid).close()
                released += 1
        shutil.rmtree(where, ignore_errors=True)
    return released


def describe(network: str) -> str:
    """A few words for the worker's plan (`aisched workers`)."""
    return {"pasta": "a network namespace of its own (outbound through pasta, no host loopback)",
            "none": "a network namespace of its own (loopback only, no outbound)",
            "host": "the host's network namespace (--network host)"}[network]
