"""The worker plugin that owns a worker's inventory, its device allocator, its trusted keys, its isolation mode,
its tenants' zygotes and the large results it keeps until their caller fetches them (dask_gpu.worker.results)."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import WorkerPlugin

from dask_gpu.worker.allocator import DeviceAllocator
from dask_gpu.worker.bodies import WARM_TOPIC, BodyPool, BodyProcess
from dask_gpu.worker.containment import body_cgroup, cgroups_unavailable
from dask_gpu.worker.finish import QueueMessages
from dask_gpu.inventory import WorkerInventory
from dask_gpu.isolation import IsolationPlan, TenantGate, plan_for
from dask_gpu.worker.live import DeviceState, sample
from dask_gpu.worker.results import DirectResults, start as start_results
from dask_gpu.worker.zygote import Zygote, kill_group

if TYPE_CHECKING:
    from distributed import Worker

PLUGIN_NAME = "dask-gpu"
WARM_HOLD = "warm-"  # what an idle warm body's devices are held under in the allocator (not a run: not in `held`)
# Under `distributed`, so the worker's own log configuration shows it (a `dask worker` logs distributed.* at INFO).
logger = logging.getLogger("distributed.dask_gpu")


class GPUWorkerPlugin(WorkerPlugin):
    """Installed on each GPU-aware worker by `dask_gpu.worker.preload`, with the keys the worker trusts."""

    name = PLUGIN_NAME

    def __init__(self, inventory: WorkerInventory, trusted_keys: dict[str, bytes] | None = None,
                 isolation: IsolationPlan | None = None) -> None:
        self.inventory = inventory
        self.trusted_keys = dict(trusted_keys or {})
        self.allocator = DeviceAllocator(inventory.devices, live=self.sample)
        self.isolation = isolation  # decided at setup (dask.config `dask-gpu.isolation`) unless given
        self.tenants: TenantGate | None = None
        self._zygotes: dict[str, Zygote] = {}
        self._zygotes_lock = threading.Lock()
        self._sandbox: list[str] | None = None
        self._uids: Any = None
        self._bodies_dir = ""
        self._cgroups: str | None = "not decided yet"  # why bodies get no cgroup here (None: they do)
        self.worker_name = ""
        self._stops: dict[str, threading.Event] = {}
        self._soft: dict[str, threading.Event] = {}  # key -> asked to stop at its next checkpoint (a time limit)
        self._started: dict[str, float] = {}  # key -> monotonic time it got its devices
        self._leases: dict[str, float] = {}  # key -> monotonic deadline; past it the body is killed
        self._stops_lock = threading.Lock()
        self.results: DirectResults | None = None  # started at setup unless dask config dask-gpu.results says off
        self.bodies = BodyPool(self._end_body)
        self._warm_told: set[str] = set()  # warm bodies the cluster's queue counts: it is told when they end
        self.queue = QueueMessages()  # what the cluster's queue is told: runs freed, warm bodies ended
        self._closing = threading.Event()
        self._reaper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dask-gpu-reaper")
        self.handover: Any = None  # the `gpu_run` handler (dask_gpu.worker.sandbox.Handover), set by the preload

    def stop_event(self, key: str) -> threading.Event:
        """The event that asks task `key` to stop; it may be set before the task starts."""
        with self._stops_lock:
            return self._stops.setdefault(key, threading.Event())

    def request_stop(self, key: str) -> None:
        self.stop_event(key).set()

    def soft_stop_event(self, key: str) -> threading.Event:
        """The event that asks task `key` to stop at its next `checkpoint()` (its body gets SIGTERM, as Slurm's time
        limit sends; `dask_gpu.body.time_stop`); it is killed only by `request_stop`."""
        with self._stops_lock:
            return self._soft.setdefault(key, threading.Event())

    def mark_started(self, key: str) -> None:
        self._started[key] = time.monotonic()

    def running_for(self, keys: list[str]) -> dict[str, float]:
        """Seconds each of `keys` has run here since it got its devices (absent: not running here)."""
        now = time.monotonic()
        return {k: now - self._started[k] for k in keys if k in self._started}

    def renew(self, keys: list[str], seconds: float) -> list[str]:
        """Extend the lease of running bodies; returns the keys that run here."""
        until = time.monotonic() + seconds
        with self._stops_lock:
            for key in keys:
                self._leases[key] = max(self._leases.get(key, 0.0), until)
        return [k for k in keys if k in self._started]

    def abandoned(self, key: str) -> str | None:
        """Why nobody waits for task `key` any more (its client went away and Dask cancelled it), or None."""
        if self.handover is not None and key in self.handover.callers:  # handed over: no Dask task to ask
            return self.handover.abandoned(key)
        worker = getattr(self, "_worker", None)
        ts = worker.state.tasks.get(key) if worker is not None else None
        if worker is not None and (ts is None or ts.state in ("cancelled", "released", "forgotten")):
            return "its client (the control plane) went away, so Dask cancelled it"
        return None

    def lease_expired(self, key: str) -> str | None:
        deadline = self._leases.get(key)
        if deadline is not None and time.monotonic() > deadline:
            return "lease expired: the control plane did not renew it in time (unreachable?), so the body was stopped"
        return None

    def forget_lease(self, key: str) -> None:
        with self._stops_lock:
            self._leases.pop(key, None)

    def devices_freed(self, queue_key: str, warm: str | None = None, keep: float = 0.0,
                      task: str | None = None) -> None:
        """Tell the cluster's queue (from a task's thread) that the body of its run `queue_key` ended here, or
        (`warm`) that it waits, warm, for the next run of its key, holding its device share for `keep` seconds: as
        Dask task `task` finishes here (dask_gpu.worker.finish)."""
        from dask_gpu.scheduler.queue import FREED_STREAM_OP

        if warm:
            self._warm_told.add(warm)
        self.queue.freed({"op": FREED_STREAM_OP, "id": queue_key, **({"warm": warm, "keep": keep} if warm else {})},
                         task)

    def transition(self, key: str, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        """Dask's hook, on the worker's event loop, for every task's change of state."""
        self.queue.transition(key, start, finish)

    def _end_body(self, body: BodyProcess, reason: str, idle: float) -> None:
        """End a body's process and everything it started; give back its devices; tell whoever counted it. Its
        cgroup (daemons that left its session too), working directory and UID are reaped next, off this path."""
        kill_group(body.pid)
        try:
            body.sock.close()
        except OSError:
            pass
        if body.hold:
            self.allocator.release(body.hold)
        if body.id in self._warm_told:  # the queue counts it as a warm body: its device share is free now
            self._warm_told.discard(body.id)
            self.queue.cold(body.id)
        if body.runs and body.idle_since is not None:  # it waited warm: the control plane charges that idle time
            worker = getattr(self, "_worker", None)
            if worker is not None:
                worker.log_event(WARM_TOPIC, {"body": body.id, "tenant": body.tenant, "key": body.key,
                                              "idle": idle, "runs": body.runs, "reason": reason,
                                              "devices": [d.key for d in body.devices], "worker": worker.address})
        logger.debug("body %s ended after %d run(s): %s", body.id, body.runs, reason)
        self._reaper.submit(self._reap, body)

    def _reap(self, body: BodyProcess) -> None:
        """What of a body is left once it was killed: every process in its cgroup, its working directory (iterative,
        never following a link: a 3,000-deep tree goes too); then its UID may be leased again."""
        try:
            if body.network is not None:  # its namespace released: its pasta exits
                body.network.close()
            if body.cgroup is not None:
                body.cgroup.remove()  # kills what is left in it first
            if body.workdir:
                from dask_gpu.isolation.cleanup import remove_tree

                try:
                    remove_tree(body.workdir)
                except FileNotFoundError:
                    pass
        except Exception:
            logger.exception("body %s could not be reaped whole (cgroup %s, working directory %s); its UID stays "
                             "out of the pool", body.id, body.cgroup, body.workdir)
            return
        self.release_identity(body.uid)

    def _expire_loop(self) -> None:
        while not self._closing.wait(0.25):
            try:
                self.bodies.expire()
            except Exception:  # keep expiring: the next turn retries
                logger.exception("ending idle warm bodies failed")

    def forget(self, key: str) -> None:
        with self._stops_lock:
            self._stops.pop(key, None)
            self._soft.pop(key, None)
            self._started.pop(key, None)

    def sample(self) -> dict[str, DeviceState] | None:
        """Live per-device utilisation and memory (NVML), or None for declared devices."""
        return sample(self.inventory)

    def zygote_for(self, tenant: str) -> Zygote:
        """The zygote of `tenant`'s bodies on this worker: one per tenant, so nothing of one reaches another's."""
        with self._zygotes_lock:
            zygote = self._zygotes.get(tenant)
            if zygote is None:
                sandbox = self._sandbox
                if sandbox is not None and self.isolation and self.isolation.settings.tenant_paths.get(tenant):
                    from dask_gpu.isolation.filesystem import with_data

                    sandbox = with_data(sandbox, self.isolation.settings.tenant_paths[tenant])
                zygote = self._zygotes[tenant] = Zygote(tenant=tenant, sandbox=sandbox)
            return zygote

    def run_identity(self, tenant: str = "", gpus: float = 0.0) -> tuple[dict[str, Any], int | None]:
        """What an isolated body's process needs: its UID (leased here), its working directory's name, its tenant's
        group and data paths (the operator's `tenant-groups`, `tenant-paths`), the size of its /tmp and /dev/shm."""
        if self._uids is None:
            return {}, None
        from dask_gpu.worker.containment import body_memory_bytes

        uid = self._uids.lease()
        settings = self.isolation.settings if self.isolation else None
        extra = {} if settings is None else {"group": settings.tenant_groups.get(tenant),
                                            "data": list(settings.tenant_paths.get(tenant, ())),
                                            "tmp_bytes": body_memory_bytes(gpus, self.isolation, self.inventory) // 2}
        return {"uid": uid, "workdir": f"{uid}-{uuid.uuid4().hex[:12]}", "tenant": tenant, **extra}, uid

    def workdir_of(self, identity: dict[str, Any]) -> str:
        """Where an isolated body's working directory lies on this host ("" for a body that has none)."""
        return os.path.join(self._bodies_dir, str(identity["workdir"])) if identity and self._bodies_dir else ""

    def contain(self, body: BodyProcess, gpus: float) -> None:
        """Put a body's process in a cgroup of its own before it runs a byte a flow sent (dask_gpu.worker.containment);
        no-op where this worker cannot make cgroups (it said why once, at start)."""
        if self._cgroups is None:
            assert self.isolation is not None
            body.cgroup = body_cgroup(body, gpus, self.isolation, self.inventory)
            body.cgroup.add(body.pid)

    def release_identity(self, uid: int | None) -> None:
        if uid is not None and self._uids is not None:
            self._uids.release(uid)

    def _isolate(self, worker: Worker) -> None:
        """Decide the mode; on an isolated worker, the sandbox every tenant's zygote runs in."""
        plan = self.isolation = self.isolation or plan_for()
        self.tenants = TenantGate(plan)
        if plan.mode != "shared" and plan.settings.tenant:  # advertised, so no other tenant's run is placed here
            self.inventory = self.inventory.model_copy(update={"tenant": plan.settings.tenant})
        if plan.mode != "isolated":
            return
        self._bodies_dir, self._sandbox, self._uids = _isolated_sandbox(worker, plan.settings,
                                                                        [d.index for d in self.inventory.devices])

    def _decide_cgroups(self) -> None:
        self._cgroups = cgroups_unavailable(self.isolation)
        if self._cgroups is not None:
            logger.warning("GPU worker: bodies get no cgroup (no memory, PID or device bound of their own): %s",
                           self._cgroups)

    def setup(self, worker: Worker) -> None:
        self.worker_address = worker.address
        self.worker_name = str(worker.name)
        self._worker = worker
        self.queue.attach(worker)
        _stop_frame_sampler(worker)
        self._isolate(worker)
        self._decide_cgroups()
        self._start_results(worker)
        assert self.isolation is not None
        logger.info("GPU worker %s isolation: %s", worker.name, self.isolation.describe())
        # The control plane reaches workers through the scheduler's broadcast: no out-of-band code, no log line per call.
        worker.handlers.update(gpu_stop=self._handle_stop, gpu_renew=self._handle_renew, gpu_end_warm=self._handle_end_warm,
                               gpu_running_for=self._handle_running_for, gpu_inventory=self._handle_inventory)
        threading.Thread(target=self._expire_loop, name="dask-gpu-warm-expiry", daemon=True).start()
        # What it advertises, once; nothing is logged per poll (the handlers above log nothing).
        logger.info("GPU worker %s (%s): %s (%s); trusts %d control-plane key(s)", worker.name, worker.address,
                    self.inventory.describe(), self.inventory.source, len(self.trusted_keys))
        if not self.trusted_keys:
            logger.warning("GPU worker %s trusts no control-plane key: it will refuse every AI task. Fix: start it "
                           "with --trust-key KEY (the key `aisched serve` prints) or DASK_GPU_TRUSTED_KEYS", worker.name)

    def _start_results(self, worker: Worker) -> None:
        """The listener large results are fetched from, on the worker's own host (port chosen now)."""
        from distributed.comm import get_address_host

        try:
            host = get_address_host(worker.address)
        except Exception:  # an address with no host (inproc): results go back as the task's value
            host = ""
        self.results = start_results(host)
        if self.results is not None:
            logger.info("GPU worker %s keeps results of %d bytes or more for their caller at %s", worker.name,
                        self.results.settings.min_bytes, self.results.base_url)

    def teardown(self, worker: Worker) -> None:
        self._closing.set()
        if self.handover is not None:
            self.handover.close()
        self.bodies.close()
        self._reaper.shutdown(wait=True)
        if self.results is not None:
            self.results.close()
            self.results = None
        with self._zygotes_lock:
            zygotes, self._zygotes = list(self._zygotes.values()), {}
        for zygote in zygotes:
            zygote.close()

    def _handle_stop(self, keys: list[str], soft: bool = False) -> list[str]:
        for key in keys:
            if soft:
                self.soft_stop_event(key).set()
            else:
                self.request_stop(key)
        return [k for k in keys if k in self._started]

    def _handle_renew(self, keys: list[str], seconds: float) -> list[str]:
        return self.renew(keys, seconds)

    def _handle_running_for(self, keys: list[str]) -> dict[str, float]:
        return self.running_for(keys)

    def _handle_end_warm(self, bodies: list[str] | None = None, keys: list[str] | None = None,
                         reason: str = "ended by the control plane") -> list[str]:
        """End idle warm bodies by id or by key (the queue evicting one for another run, the control plane ending
        those whose authority ended); a body busy with a run is not touched here (its run is stopped the run's way)."""
        ids, wanted = set(bodies or ()), set(keys or ())
        return self.bodies.end_idle(lambda b: b.id in ids or b.key in wanted, reason)

    def _handle_inventory(self) -> dict:
        plan = self.isolation
        return {"name": self.worker_name, "inventory": self.inventory.model_dump(mode="json"),
                "held": {k: v for k, v in self.allocator.holders().items() if not k.startswith(WARM_HOLD)}, "usage": self.allocator.usage(),
                "isolation": plan.mode if plan else "", "isolation_detail": plan.describe() if plan else "",
                "results": self.results.base_url if self.results else "", "warm": self.bodies.idle(),
                "warm_report": self.bodies.report()}


def _stop_frame_sampler(worker: Worker) -> None:
    """Stop the worker's statistical profiler (`distributed.worker.profile`): it deadlocks this worker.

    Every body's thread secedes and ends with its task, so a GPU worker ends a thread per run. CPython before
    3.12 (gh-106883, on the 3.11.7 here) deadlocks when a thread ends (it holds the GIL and waits for the runtime's
    thread-list lock) while another is inside `sys._current_frames()` (it holds that lock and, once a garbage
    collection it triggered calls distributed's GC callback, which releases the GIL, waits for the GIL): the
    profiler calls it every 10 ms. bench/overhead.py's 1,000-task row hung so, every thread of a worker on one
    futex. The profiler only ever sampled the worker's own threads: a body runs in a process of its own.
    """
    for name in ("profile", "profile-cycle"):
        pc = worker.periodic_callbacks.pop(name, None)
        if pc is not None:
            pc.stop()


def _isolated_sandbox(worker: Worker, settings: Any, indices: list[int]) -> tuple[str, list[str], Any]:
    """An isolated worker's bodies folder, the sandbox every tenant's zygote runs in, and its UID pool: nothing of
    the worker's own (its local directory, its TLS folder) is bound into a body."""
    import sys

    from dask_gpu.isolation import devices, filesystem, identity

    local = str(getattr(worker, "local_directory", "") or "")
    bodies = settings.bodies_dir or os.path.join(local or "/var/lib/dask-gpu", "bodies")
    os.makedirs(bodies, mode=0o711, exist_ok=True)
    os.chmod(bodies, 0o711)
    scratch = [local, os.path.dirname(local)] if local else []  # Dask puts these on sys.path: never bound
    security = getattr(worker, "security", None)
    fields = [f"tls_{who}_{what}" for who in ("worker", "client", "scheduler") for what in ("cert", "key")]
    found = [getattr(security, f, None) for f in ("tls_ca_file", *fields)] if security is not None else []
    secrets = {v for v in found if isinstance(v, str) and os.path.isfile(v)}
    for path in list(secrets):  # the whole TLS folder: on one host it may hold the control plane's key too
        folder = os.path.dirname(path)
        secrets.update(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith((".key", ".pem")))
    sandbox = filesystem.sandbox_argv(
        settings.bwrap, read_only=filesystem.code_paths(filesystem.without(sys.path, scratch), settings.extra_paths),
        hide=[local, *secrets], devices=devices.sandbox_nodes(settings.device_nodes,
                                                             indices),
        bodies_dir=bodies)
    uids = identity.UidPool(*settings.body_uids, locks=settings.uid_locks)
    if settings.network == "pasta":  # what a killed worker left: its bodies' namespaces, held for their pasta
        from dask_gpu.isolation.network import sweep_stale

        sweep_stale(settings.netns_dir)
    return bodies, sandbox, uids
