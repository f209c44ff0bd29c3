"""A GPU cluster of separate processes, started the way docs/how-to/gpu-cluster.md tells an operator to.

`dask-gpu-scheduler --tls-dir DIR` (or, to test Dask's defaults, a plain `dask scheduler` on the same TLS
files), one `dask-gpu-worker --tls-dir DIR --trust-key KEY --declared ...` per host (each with its nanny,
as `dask worker` starts it), and `aisched serve --dask-address ... --dask-tls DIR` (ControlPlaneProcess).
Every process writes its log to a file of its own, so a test can read what a worker logged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent


class ClusterProcs:
    """Scheduler, workers and a control plane, each a process of its own; `close()` ends them all."""

    def __init__(self, root: Path, *, product_scheduler: bool = True, queue: bool = True,
                 env: dict[str, str] | None = None) -> None:
        from aisched_prefect.control.service import load_or_make_key
        from dask_gpu.tickets import TicketSigner

        self.root, self.product, self.queue = root, product_scheduler, queue
        self.tls = root / "tls"
        self.home = root / "control-plane"
        self.home.mkdir(parents=True, exist_ok=True)
        self.key = TicketSigner(load_or_make_key(self.home / "control.key")).public_key.hex()
        self.env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        self.procs: dict[str, subprocess.Popen] = {}
        self.address = ""
        self.plane: Any = None

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "w")
        proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text()

    def start_scheduler(self, port: int = 0) -> str:
        """Start the scheduler (`port`: a fixed one, e.g. the one a killed scheduler had)."""
        file = self.root / "scheduler.json"
        file.unlink(missing_ok=True)
        # Its HTTP server on a free port too: the default 127.0.0.1:8787 is host-wide, and the product refuses a taken
        # one (dask_gpu.ports), so two tests (or anyone's scheduler on this host) side by side would collide there.
        common = ["--host", "127.0.0.1", "--port", str(port), "--no-dashboard", "--dashboard-address", "127.0.0.1:0",
                  "--scheduler-file", str(file)]
        if self.product:
            self._spawn("scheduler", [str(BIN / "dask-gpu-scheduler"), "--tls-dir", str(self.tls), *common])
        else:  # Dask's own scheduler, its default settings (allowed-failures 3, no preloads), the same TLS files
            from dask_gpu.security import ClusterTLS

            ClusterTLS.load_or_create(self.tls)
            self._spawn("scheduler", [str(BIN / "dask"), "scheduler", "--protocol", "tls",
                                      "--tls-ca-file", str(self.tls / "ca.pem"), "--tls-cert", str(self.tls / "scheduler.pem"),
                                      "--tls-key", str(self.tls / "scheduler.key"), *common])
        deadline = time.time() + 60
        while not file.exists() or not file.read_text().strip():
            if time.time() > deadline or self.procs["scheduler"].poll() is not None:
                raise RuntimeError(f"the scheduler did not start:\n{self.log('scheduler')}")
            time.sleep(0.1)
        time.sleep(0.2)  # the file is written whole, but give the listener a moment
        self.address = json.loads(file.read_text())["address"]
        return self.address

    def warm_bodies(self) -> list[dict]:
        """The warm bodies every worker reports (its `gpu_inventory`'s `warm`)."""
        with self.client() as client:
            found = client.sync(client.scheduler.broadcast, msg={"op": "gpu_inventory"})
        return [b for answer in found.values() for b in answer.get("warm", [])]

    def end_warm_bodies(self, timeout: float = 60.0) -> None:
        """Each test starts on an empty device: bodies a test left warm are ended (and settled) first."""
        from tests.helpers import wait_until

        ids = [b["id"] for b in self.warm_bodies()]
        if ids:
            with self.client() as client:
                client.sync(client.scheduler.broadcast, msg={"op": "gpu_end_warm", "bodies": ids})
        wait_until(lambda: not self.warm_bodies(), timeout, "the warm bodies of earlier tests to end")

    def start_worker(self, name: str, declared: str, nthreads: int = 2) -> None:
        self._spawn(name, [str(BIN / "dask-gpu-worker"), self.address, "--tls-dir", str(self.tls),
                           "--trust-key", self.key, "--declared", declared, "--name", name,
                           "--nthreads", str(nthreads), "--host", "127.0.0.1", "--no-dashboard"])

    def client(self) -> Any:
        from distributed import Client

        from dask_gpu.security import ClusterTLS

        return Client(self.address, set_as_default=False, security=ClusterTLS(self.tls).security("client"))

    def wait_for_workers(self, n: int, timeout: float = 60) -> None:
        with self.client() as client:
            client.wait_for_workers(n, timeout=timeout)

    def start_plane(self) -> Any:
        from tests.controlplane import ControlPlaneProcess

        self.plane = ControlPlaneProcess(self.home, dask_address=self.address, dask_tls=self.tls, queue=self.queue,
                                         env={k: v for k, v in self.env.items() if k.startswith("AISCHED_")}).start()
        return self.plane

    def worker_pid(self, address: str) -> int:
        """The pid of the worker process (not its nanny) listening at `address`."""
        with self.client() as client:
            return client.run(os.getpid, workers=[address])[address]

    def close(self) -> None:
        if self.plane is not None:
            self.plane.stop()
        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@contextmanager
def single_host(root: Path, env: dict[str, str] | None = None, declared: str = "1 GPU, 80 GB, H100") -> Iterator[ClusterProcs]:
    """A scheduler, one worker (`gpu-host`, `declared`) and a control plane, ended however the block ends."""
    procs = ClusterProcs(root, env=env)
    try:
        procs.start_scheduler()
        procs.start_worker("gpu-host", declared, nthreads=2)
        procs.wait_for_workers(1)
        procs.start_plane()
        yield procs
    finally:
        procs.close()


def kill_worker_process(pid: int) -> None:
    """SIGKILL a worker process (its nanny restarts it at a new address, as on a real host)."""
    psutil.Process(pid).kill()
