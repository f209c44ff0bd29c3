"""An unisolated worker's one tenant is fixed at its start, so a restart under its nanny does not let another in.

Before: a `dask-gpu-worker` that could not isolate (not root, no bubblewrap, or `--isolation unisolated`) started
without `--tenant` and served "the first tenant whose body it ran", a fact kept only in the worker process's memory
(`TenantGate`). Tenant A's body, running as the worker's own user, kills the worker; the nanny restarts it; the new
process remembers no tenant and admits tenant B's body, which A's daemon, still there, reads. Now such a worker
refuses to start without `--tenant` (one line naming the flag and the fix), and the tenant it was given is what its
restarted process reads (the nanny's environment), so B is refused before and after the restart.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import cloudpickle
import psutil
import pytest

from dask_gpu import GPURequest
from dask_gpu.body.code import code_digest
from dask_gpu.isolation import TenantRefused
from dask_gpu.worker.sandbox import Body, run_ticketed
from dask_gpu.tickets import TicketSigner, digest
from tests.attacks.support import wait_for
from tests.clusterprocs import BIN, ClusterProcs

REQUEST = GPURequest(gpus=1, gpu_type="L4")


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_DASK_GPU__ISOLATION__")}
    (tmp / "dask-tmp").mkdir(exist_ok=True)
    return {**env, "DASK_TEMPORARY_DIRECTORY": str(tmp / "dask-tmp"), **extra}


@pytest.mark.parametrize("flags, extra_env, says", [
    (["--isolation", "unisolated"], {}, "--isolation unisolated serves one tenant, fixed at start"),
    # `auto` (the default) on a host that cannot isolate: here, bubblewrap where there is none.
    ([], {"DASK_DASK_GPU__ISOLATION__BWRAP": "/nonexistent/bwrap"}, "this worker cannot isolate bodies ("),
])
def test_a_worker_that_does_not_isolate_refuses_to_start_without_its_tenant(tmp_path, flags, extra_env, says):
    done = subprocess.run([str(BIN / "dask-gpu-worker"), "tls://127.0.0.1:1", "--declared", "1 GPU, 24 GB, L4",
                           "--name", "single", *flags], env=_env(tmp_path, **extra_env), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done
    line = done.stderr
    assert line.startswith("dask-gpu-worker: ") and line.count("\n") == 1, line  # one line, before Dask starts
    assert says in line and "Fix: start it for that tenant (--tenant NAME" in line, line


def _body():
    """Pickled by value (defined in a function), so the body's process need not import this test module."""

    def pid() -> int:
        import os

        return os.getpid()

    return pid


def _submit(client, signer: TicketSigner, tenant: str):
    fn = _body()
    body = Body(payload=cloudpickle.dumps(fn) + cloudpickle.dumps(((), {})))
    ticket = signer.issue(run=f"single-{time.monotonic_ns()}", payload_digest=digest(body.payload),
                          code_digest=code_digest(fn), request=REQUEST, tenant=tenant)
    return client.submit(run_ticketed, ticket, body, workers=["single"], allow_other_workers=False,
                         resources=REQUEST.resources(), pure=False)


def test_a_restarted_unisolated_worker_still_serves_only_the_tenant_it_was_started_for(tmp_path):
    from aisched_prefect.control.service import load_or_make_key
    from dask_gpu.client.cluster import worker_addresses

    cluster = ClusterProcs(tmp_path, env=_env(tmp_path))
    try:
        cluster.start_scheduler()
        nanny = cluster._spawn("single", [str(BIN / "dask-gpu-worker"), cluster.address, "--tls-dir", str(cluster.tls),
                                          "--trust-key", cluster.key, "--declared", "1 GPU, 24 GB, L4", "--name",
                                          "single", "--nthreads", "2", "--host", "127.0.0.1", "--no-dashboard",
                                          "--isolation", "unisolated", "--tenant", "team-a"])
        cluster.wait_for_workers(1)
        signer = TicketSigner(load_or_make_key(cluster.home / "control.key"))
        with cluster.client() as client:
            before = worker_addresses(client)["single"]
            out = _submit(client, signer, "team-a").result(timeout=60)
            assert out.ok, out.error_text
            with pytest.raises(TenantRefused, match="serves tenant 'team-a' only"):
                _submit(client, signer, "team-b").result(timeout=60)

            # The worker process dies (tenant A's body, as the worker's user, can kill it); its nanny starts another.
            pid = cluster.worker_pid(before)
            worker = psutil.Process(pid)
            assert nanny.pid in [p.pid for p in worker.parents()], "not the worker of the nanny this test started"
            assert b"multiprocessing" in Path(f"/proc/{pid}/cmdline").read_bytes()
            os.kill(pid, signal.SIGKILL)

            def restarted() -> str | None:
                address = worker_addresses(client).get("single")
                return address if address and address != before else None

            after = wait_for(restarted, 90, "the nanny to restart the worker")
            assert cluster.worker_pid(after) != pid
            with pytest.raises(TenantRefused, match="serves tenant 'team-a' only, because it was started for that"):
                _submit(client, signer, "team-b").result(timeout=60)
            out = _submit(client, signer, "team-a").result(timeout=60)
            assert out.ok, out.error_text
        log = cluster.log("single")
        assert log.count("unisolated (the operator chose --isolation unisolated): bodies run as the worker's own "
                         "user; it serves tenant team-a only") >= 3, log[-3000:]  # the CLI, then each worker process
    finally:
        cluster.close()
