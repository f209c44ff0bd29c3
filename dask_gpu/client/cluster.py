"""A local Dask cluster of GPU-aware worker processes, and reading a cluster's inventory."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from distributed import Client, Nanny, Scheduler, SpecCluster
from distributed.deploy.spec import ProcessInterface
from pydantic import BaseModel

from dask_gpu.inventory import DECLARED_ENV, WorkerInventory, parse_declared
from dask_gpu.worker.live import DeviceState
from dask_gpu.worker.plugin import PLUGIN_NAME, GPUWorkerPlugin
from dask_gpu.security import ClusterTLS
from dask_gpu.tickets import TRUSTED_KEYS_ENV

logger = logging.getLogger("distributed.dask_gpu")

PRELOAD = "dask_gpu.worker.preload"
NANNY_PRELOAD = "dask_gpu.worker.nanny_preload"
SCHEDULER_PRELOAD = "dask_gpu.scheduler.preload"


class SchedulerProcess(ProcessInterface):
    """The cluster's scheduler in a process of its own: `dask-gpu-scheduler`, as a GPU cluster runs it.

    Why: inside the control plane's process the scheduler shares the GIL and the event loop with the plane's Dask
    client, its HTTP server and its dispatch threads; a `.map()` of 10,000 shards kept that one loop so busy that
    the client lost its own in-process scheduler. Its own process gives it its own loop and core, as in production.
    It dies with the process that started it (PR_SET_PDEATHSIG), so a killed control plane leaves no scheduler.
    """

    def __init__(self, host: str = "127.0.0.1", tls_dir: str | None = None, timeout: float = 60.0) -> None:
        self.host, self.tls_dir, self.timeout = host, tls_dir, timeout
        self.process: asyncio.subprocess.Process | None = None
        self._dir = tempfile.mkdtemp(prefix="dask-gpu-scheduler-")
        super().__init__()

    async def start(self) -> None:
        file, log = Path(self._dir, "scheduler.json"), Path(self._dir, "scheduler.log")
        cmd = [sys.executable, "-m", "dask_gpu.scheduler.cli", "--host", self.host, "--port", "0",
               "--dashboard-address", f"{self.host}:0", "--scheduler-file", str(file),
               *(["--tls-dir", self.tls_dir] if self.tls_dir else ["--no-tls"])]
        with open(log, "wb") as out:
            # Its scratch folder in its own folder too (Dask's default: /tmp/dask-scratch-space, one per host).
            env = os.environ if os.environ.get("DASK_TEMPORARY_DIRECTORY") else \
                {**os.environ, "DASK_TEMPORARY_DIRECTORY": self._dir}
            self.process = await asyncio.create_subprocess_exec(*cmd, stdout=out, stderr=out, env=env,
                                                                preexec_fn=_die_with_parent)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while self.process.returncode is None and loop.time() < deadline:
            try:
                self.address = json.loads(file.read_text())["address"]
                break
            except (OSError, ValueError, KeyError):
                await asyncio.sleep(0.05)
        else:
            tail = log.read_text(errors="replace")[-2000:]
            await self.close()
            raise RuntimeError(f"the cluster's scheduler did not start within {self.timeout:.0f}s: {tail}")
        await super().start()

    async def close(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 30)
            except asyncio.TimeoutError:
                self.process.kill()
                await self.process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)  # its scheduler file and log: a folder of its own, not kept
        await super().close()


class HealthOnlyScheduler(Scheduler):
    """Dask's scheduler whose HTTP server answers `/health` only, as `dask-gpu-scheduler` without `--dashboard`.

    Dask's other routes (`/info`, `/json`, `/metrics`, `/eventstream`) serve every task's key to whoever reaches
    the port. The routes are read once, in the constructor: the setting is in force for it alone.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import dask

        from dask_gpu.scheduler.cli import HEALTH_ONLY, ROUTES_KEY

        with dask.config.set({ROUTES_KEY: list(HEALTH_ONLY)}):
            super().__init__(*args, **kwargs)


def _die_with_parent() -> None:
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LocalGPUCluster(SpecCluster):
    """Worker processes on this host that advertise GPUs as Dask resources.

    With `declared` (or DASK_GPU_DECLARED) each declared worker becomes one
    process that advertises its declared devices; otherwise a single worker owns
    every device NVML finds (none, on a machine without GPUs). Either way the
    worker runs `dask_gpu.worker.preload`, exactly as a remote `dask worker` would.
    `allowed_failures=0` (Dask's default is 3) makes a task whose worker dies
    fail with KilledWorker, so its retry goes through the caller's policy.
    With `tls` (a `ClusterTLS`), scheduler and workers speak only mutual TLS:
    a client without the CA's client certificate cannot connect. Each worker
    trusts the `trusted_keys` for tickets (fixed here, at start).
    `isolation` is the workers' mode (dask_gpu.isolation): by default the
    dask config's `dask-gpu.isolation.mode`, else `shared`, since a local
    cluster is one user's host (the embedded control plane, `make demo`), whose
    bodies share its files; `"auto"` isolates bodies where the workers run as
    root with bubblewrap, as `dask-gpu-worker` does on a GPU host.
    `scheduler_process=True` runs the scheduler as `dask-gpu-scheduler` in a
    process of its own (`SchedulerProcess`; the embedded control plane does);
    by default it runs in this process, as Dask's LocalCluster's does. Either way
    its HTTP server answers `/health` only, on `host`.
    Its workers and scheduler keep their scratch files in a folder of this
    cluster's own, removed when it closes (unless dask's `temporary-directory`
    is set: Dask's default is one folder per host, shared by every cluster).
    `tenant` is the one tenant an `unisolated` worker serves (required there:
    `isolation="unisolated"`, or `"auto"` where the workers cannot isolate,
    without it is refused here, as `dask-gpu-worker` refuses it).
    """

    def __init__(
        self,
        declared: str | None = None,
        threads_per_worker: int | None = None,
        host: str = "127.0.0.1",
        silence_logs: int | bool = logging.WARNING,
        allowed_failures: int = 0,
        trusted_keys: list[str] | None = None,
        tls: ClusterTLS | None = None,
        isolation: str | None = None,
        scheduler_process: bool = False,
        tenant: str | None = None,
        **kwargs: Any,
    ) -> None:
        import dask

        from dask_gpu.isolation import CONFIG_KEY, MODES, IsolationError, plan_for, settings_from_config

        mode = isolation or dask.config.get(f"{CONFIG_KEY}.mode", default=None) or "shared"
        if mode not in MODES:
            raise ValueError(f"LocalGPUCluster(isolation={mode!r}): expected one of {', '.join(MODES)}")
        isolation_config: dict[str, Any] = {"mode": mode, **({"tenant": tenant} if tenant else {})}
        if mode != "shared":  # the workers are processes of this host and user: what they would decide, decided here
            settings = settings_from_config().model_copy(update=isolation_config)
            try:
                plan_for(settings)
            except IsolationError as exc:
                raise IsolationError(f"LocalGPUCluster(isolation={mode!r}): {exc} (here: tenant=NAME)") from None
        security = tls.security("cluster") if tls is not None else None
        protocol = {"protocol": "tls", "security": security} if security is not None else {}
        spec = declared if declared is not None else os.environ.get(DECLARED_ENV)
        # Per worker: (DASK_GPU_DECLARED for that process or None for NVML, device count).
        plan: list[tuple[str | None, int]] = (
            [(g.spec(), g.gpus) for g in parse_declared(spec, "LocalGPUCluster(declared=...)" if declared is not None
                                                        else DECLARED_ENV) for _ in range(g.workers)]
            if spec
            else [(None, 0)]
        )
        workers: dict[str, dict[str, Any]] = {}
        # The workers' scratch folder: one of this cluster's own, removed with it (Dask's default is one folder per
        # host, /tmp/dask-scratch-space, shared by every cluster there), unless the operator set Dask's own.
        self._scratch = None if dask.config.get("temporary-directory", default=None) else \
            tempfile.mkdtemp(prefix="dask-gpu-local-")
        for i, (worker_spec, gpus) in enumerate(plan):
            env = {DECLARED_ENV: worker_spec} if worker_spec else {}
            if trusted_keys:
                env[TRUSTED_KEYS_ENV] = ",".join(trusted_keys)
            workers[f"gpu-worker-{i}"] = {
                "cls": Nanny,
                "options": {
                    # Bodies run in processes of their own and leave the thread pool once admitted, so threads
                    # never bound what shares a device; a few serve the rest of a worker's tasks.
                    "nthreads": threads_per_worker or max(4, 4 * gpus + 2),
                    "host": host,
                    "preload": [PRELOAD],
                    "preload_nanny": [NANNY_PRELOAD],
                    "config": {"dask-gpu": {"isolation": isolation_config}},  # the worker process reads it
                    "env": env,
                    "silence_logs": silence_logs,
                    "dashboard": False,
                    **({"local_directory": self._scratch} if self._scratch else {}),
                    **protocol,
                },
            }
        scheduler = {
            "cls": HealthOnlyScheduler,
            # A task whose worker dies fails at once (KilledWorker) instead of being re-run
            # silently: the caller's retry policy decides, and each attempt is accounted.
            "options": {"host": host, "dashboard": False, "dashboard_address": f"{host}:0",
                        "allowed_failures": allowed_failures, "preload": [SCHEDULER_PRELOAD],
                        **({"local_directory": self._scratch} if self._scratch else {}),
                        **({"protocol": "tls", "security": tls.security("scheduler")} if tls is not None else {})},
        }
        if scheduler_process:
            if allowed_failures != 0:
                raise ValueError("LocalGPUCluster(scheduler_process=True) runs dask-gpu-scheduler, whose "
                                 "allowed_failures is 0: pass allowed_failures=0, or scheduler_process=False")
            scheduler = {"cls": SchedulerProcess, "options": {
                "host": host, "tls_dir": str(tls.directory) if tls is not None else None}}
        if tls is not None:  # this object talks to its scheduler as the one client (the control plane that made it)
            kwargs["security"] = tls.security("client")
        super().__init__(workers=workers, scheduler=scheduler, silence_logs=silence_logs, **kwargs)

    async def _close(self) -> None:
        await super()._close()
        if self._scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)


BROADCAST_SECONDS_KEY = "dask-gpu.broadcast-seconds"  # how long a worker may take to answer a broadcast


def broadcast(client: Client, op: str, **msg: Any) -> dict[str, Any]:
    """Ask every worker's GPU plugin (`op`: gpu_stop, gpu_renew, gpu_running_for, gpu_inventory), one round trip.

    Goes through the scheduler's broadcast to handlers the preload installed:
    no code is shipped and workers log nothing per call. Workers without the
    plugin are skipped. The scheduler's broadcast waits for every worker with no
    timeout: one worker that stopped answering (a deadlocked or stopped process,
    until the scheduler's worker-ttl removes it) held the control plane's
    inventory read, and every admission behind it, for good. Past
    `dask-gpu.broadcast-seconds` (10 s) each worker is asked on its own, with
    that timeout, and the answers of those that answer are returned.
    """
    import dask

    msg = {"op": op, **msg}
    timeout = float(dask.config.get(BROADCAST_SECONDS_KEY, default=10.0))
    try:
        return client.sync(client.scheduler.broadcast, msg=msg, on_error="ignore", callback_timeout=timeout)
    except (asyncio.TimeoutError, TimeoutError):
        return client.sync(_each_worker, client, msg, timeout)


async def _each_worker(client: Client, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
    workers = list((await client.scheduler.identity())["workers"])
    answers = await asyncio.gather(*(asyncio.wait_for(client.scheduler.broadcast(
        msg=msg, workers=[w], on_error="ignore"), timeout) for w in workers), return_exceptions=True)
    out: dict[str, Any] = {}
    slow = []
    for worker, answer in zip(workers, answers):
        if isinstance(answer, BaseException):
            slow.append(worker)
        else:
            out.update(answer)
    if slow:
        logger.warning("GPU worker(s) %s did not answer %s within %.0fs: left out (a hung worker is removed by the "
                       "scheduler's worker-ttl)", ", ".join(slow), msg.get("op"), timeout)
    return out


def _answers(found: dict[str, Any]) -> list[Any]:
    return [v for v in found.values() if v is not None and not isinstance(v, Exception)]


def cluster_inventories(client: Client) -> dict[str, WorkerInventory]:
    """Worker name -> inventory, for every worker connected now (one round trip).

    Keyed by name, not address: a worker that dies and is restarted by its
    nanny keeps its name, so a placement restricted to it stays valid.
    """
    out: dict[str, WorkerInventory] = {}
    for address, answer in broadcast(client, "gpu_inventory").items():
        if isinstance(answer, dict) and "inventory" in answer:
            out[answer["name"] or address] = WorkerInventory.model_validate(answer["inventory"])
    return out


class WorkerView(BaseModel):
    """One worker as an operator reads it: its devices, what each holds now, and for which task."""

    name: str
    address: str
    inventory: WorkerInventory
    held: dict[str, list[str]]  # Dask key of a running task -> keys of the devices it holds
    usage: dict[str, tuple[float, float]]  # device key -> (share in use, GB reserved)
    isolation: str = ""  # "isolated", "unisolated" or "shared" (dask_gpu.isolation); "": an older worker
    isolation_detail: str = ""  # the worker's one line about it, as it logged at start
    results: str = ""  # where it serves the large results it keeps (dask_gpu.worker.results); "": it keeps none
    warm: list[dict[str, Any]] = []  # its idle warm bodies (dask_gpu.worker.bodies): id, tenant, devices, runs, idle, keep

    def free(self) -> dict[str, float]:
        """Device key -> share of it still free."""
        return {k: round(1.0 - used, 6) for k, (used, _) in self.usage.items()}


def cluster_view(client: Client) -> list[WorkerView]:
    """Every GPU worker with its devices and their holders, one round trip."""
    out = []
    for address, answer in broadcast(client, "gpu_inventory").items():
        if isinstance(answer, dict) and "inventory" in answer:
            out.append(WorkerView(name=answer["name"] or address, address=address, inventory=answer["inventory"],
                                  held=answer["held"], usage=answer["usage"], isolation=answer.get("isolation", ""),
                                  isolation_detail=answer.get("isolation_detail", ""),
                                  results=answer.get("results", ""), warm=answer.get("warm", [])))
    return sorted(out, key=lambda w: w.name)


def worker_addresses(client: Client) -> dict[str, str]:
    """Worker name -> address, for placing by name."""
    return {str(w["name"]): addr for addr, w in client.scheduler_info(n_workers=-1)["workers"].items()}


def _worker_states(dask_worker: Any) -> tuple[str, dict[str, Any] | None]:
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    states = plugin.sample() if isinstance(plugin, GPUWorkerPlugin) else None
    return str(dask_worker.name), None if states is None else {k: v.model_dump() for k, v in states.items()}


def cluster_states(client: Client) -> dict[str, dict[str, DeviceState] | None]:
    """Worker name -> live state of each device (None where devices are declared), one round trip."""
    raw = client.run(_worker_states)
    return {name: None if states is None else {k: DeviceState(**v) for k, v in states.items()}
            for name, states in raw.values()}


def running_for(client: Client, keys: list[str]) -> dict[str, float]:
    """Seconds each task of `keys` has run since its worker gave it devices; absent: not started.

    One round trip to every worker, asked only about tasks whose start matters
    (say, one that may be nearing the runtime its budget covers), so running
    tasks cost the scheduler no messages of their own.
    """
    out: dict[str, float] = {}
    for found in _answers(broadcast(client, "gpu_running_for", keys=list(keys))):
        out.update(found)
    return out


def request_stop(client: Client, keys: list[str], soft: bool = False) -> None:
    """Stop the tasks `keys` wherever they run or will run (one round trip to every worker).

    An admitted body runs in its own process, which is killed with everything it
    started; a task not started yet stops before it starts. With `soft`, a running body is only asked to stop:
    SIGTERM, and its `checkpoint()` raises StopRequested (a time limit, `dask_gpu.body.time_stop`).
    """
    broadcast(client, "gpu_stop", keys=list(keys), **({"soft": True} if soft else {}))


def end_warm(client: Client, bodies: list[str], reason: str = "ended by the control plane") -> list[str]:
    """End these idle warm bodies wherever they wait (one round trip to every worker); the ids ended."""
    out: list[str] = []
    for found in _answers(broadcast(client, "gpu_end_warm", bodies=list(bodies), reason=reason)):
        out.extend(found)
    return out


def renew_leases(client: Client, keys: list[str], seconds: float) -> set[str]:
    """Extend the lease of running bodies by `seconds`; returns the keys some worker runs now."""
    out: set[str] = set()
    for found in _answers(broadcast(client, "gpu_renew", keys=list(keys), seconds=seconds)):
        out.update(found)
    return out
