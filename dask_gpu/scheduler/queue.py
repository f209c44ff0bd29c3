"""One queue for every client of a Dask cluster: a scheduler plugin that releases GPU work only when it can start.

Why in the scheduler: it is the one process every flow run on the cluster
already talks to, it knows which workers exist and what they hold, and it
outlives any flow process: when a client goes away, its queued and running
entries are dropped and the GPUs it held are offered to the others at once.
(The ledger would survive a scheduler restart too, but every decision would
cost a database round trip and polling; Prefect's concurrency limits have no
order, priority or fairness.)

A client asks once per run (`run`, one round trip under a key the client
chose): the call returns the worker the run must go to, when the policy starts
it. The client submits it there with `workers=[...]`, so Dask never holds a GPU
task that waits behind another, and tells the plugin when it ended (`leave`,
by the same key; also how a run still queued is taken out).

Gangs: a run wider than every worker it may use needs several whole workers,
all at once. The policy starts it only when enough workers are idle, and
`run` then returns the list of their addresses (the first is where the lead
task goes) instead of one address; their GPUs stay held until `leave`. A run
that fits one worker gets one address, as before.

Devices: the plugin learns each worker's devices (its `gpu_inventory`) and
chooses which ones a run gets (`place` answers them; the worker's allocator
takes exactly those), so its books and the workers' agree. A fraction of a GPU
(`gpus` below 1) starts at once on a device already shared whose share and
memory still fit (the fullest that does: best fit), on any eligible worker;
only a fraction that needs a fresh device waits in the policy, as a one-GPU
run, and the device it opens stays counted as busy until its last fraction
leaves. So fractions start on what is free now, never wait behind a busy
host, and a worker's thread count never caps them.

Preemption (Kueue's reclaim): a run entered `preemptible` may borrow idle
GPUs beyond its tenant's quota for any length of time; when another tenant's
run fits its quota but no host, the policy picks borrowed runs to stop, the
plugin frees their GPUs at once and asks their workers to stop them (the
worker's stop path: a subprocess is killed, Python stops at `checkpoint()`),
and `leave` tells their client they were preempted, so it charges what ran
and queues them again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from functools import partial
from typing import Any

from distributed import Client
from distributed.diagnostics.plugin import SchedulerPlugin

from dask_gpu.worker.bodies import COLD_STREAM_OP
from dask_gpu.scheduler.devices import UNITS, Device, DevicePlacement, Spec
from dask_gpu.scheduler.books import REQUEUE_SECONDS, PolicyBooks, run_shape  # noqa: F401 - REQUEUE_SECONDS: where callers look
from dask_gpu.scheduler.membership import Membership
from dask_gpu.scheduler.share_lines import ShareLines
from dask_gpu.scheduler.metrics import QueueMeter, snapshot
from dask_gpu.scheduler.stream import PLACED_STREAM_OP, QueueStream  # noqa: F401 - PLACED_STREAM_OP: where callers look
from dask_gpu.policies.config import PolicyConfig
from dask_gpu.policies.interface import ClusterState, Job, Policy, Running
from dask_gpu.scheduler.warm import WarmPlacement

logger = logging.getLogger("distributed.dask_gpu")
PLUGIN_NAME = "dask-gpu-queue"
LEAVE_STREAM_OP = "gpu-queue-leave"  # a run ended: sent on the client's batched stream, no round trip
ENTER_STREAM_OP = "gpu-queue-enter"  # queue a run: on the client's batched stream, no connection held while it waits
FREED_STREAM_OP = "gpu-queue-freed"  # from the worker a run is placed on, on its stream: the body ended, its devices are free


class GPUQueuePlugin(QueueStream, Membership, DevicePlacement, WarmPlacement, ShareLines, PolicyBooks, SchedulerPlugin):
    """Holds the cluster's queue of GPU runs and starts them with a pure policy (FinishTimeFair by default: no GPU
    held idle while a run that fits waits, beyond EASY's reservations; preemptible runs give borrowed GPUs back;
    fairness memory halving weekly)."""

    name = PLUGIN_NAME

    def __init__(self, policy: Policy | None = None) -> None:
        self.policy = policy or PolicyConfig.from_dask().build()  # the live configuration (also the simulator's)
        self.addresses: list[str] = []  # host index -> worker address (append-only; a gone worker keeps its index)
        self.state = ClusterState(free=[])
        self.waiters: dict[int, tuple[str, Job]] = {}  # queued: job id -> (client, job)
        self.running: dict[int, tuple[Running, str]] = {}
        self.ids = itertools.count(1)
        self.answers: dict[int, asyncio.Future] = {}  # job id -> its worker, once started (None: left the queue)
        self.keys: dict[str, int] = {}  # the client's key of a run -> its job id, until it leaves
        self.tasks: dict[int, str] = {}  # job id -> the Dask key it runs under (what a preemption stops)
        self.preempted: dict[int, tuple[str, str]] = {}  # job id -> (tenant it gave its GPUs to, its client), until it leaves
        self.preemptions = 0
        self.scheduler: Any = None
        self.devices: dict[str, list[Device]] = {}  # worker address -> its devices, once learned
        self.tenant_of: dict[str, str | None] = {}  # worker address -> the one tenant it serves (None: any)
        self._learning: dict[str, asyncio.Future] = {}
        self.specs: dict[int, Spec] = {}  # job id -> what it asks of devices (queued or running)
        self.fractions: dict[int, tuple[str, Device, int, float, str]] = {}  # running fractions: (worker, device,
        # units, GB, client)
        self.assigned: dict[int, list[tuple[str, list[str]]]] = {}  # running whole runs: (worker, device keys)
        self.fraction_runs: dict[int, tuple[Job, float, float]] = {}  # running fractions: (job, start, share)
        self.shapes: dict[int, tuple] = {}  # running preemptible runs: what their client asked (`run_shape`)
        self.requeue: dict[int, tuple[float, str, tuple, Job]] = {}  # preempted runs: (when, client, shape, job),
        # until their client enters them again (they keep their id and first submit) or `REQUEUE_SECONDS` pass
        self._dispatch_pending = False
        self.meter = QueueMeter()  # wait times as runs start (queue_metrics.py); the rest is read when scraped
        self._warm_init()
        self._share_init()

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        scheduler.handlers["gpu_queue_run"] = self.run
        scheduler.handlers["gpu_queue_place"] = self.place
        scheduler.handlers["gpu_queue_leave"] = self.leave
        scheduler.handlers["gpu_queue_status"] = self.status
        scheduler.handlers["gpu_queue_metrics"] = partial(snapshot, self)  # Prometheus: never a task key
        if hasattr(scheduler, "stream_handlers"):
            scheduler.stream_handlers[LEAVE_STREAM_OP] = self._leave_stream
            scheduler.stream_handlers[ENTER_STREAM_OP] = self._enter_stream
            scheduler.stream_handlers[FREED_STREAM_OP] = self._freed_stream
            scheduler.stream_handlers[COLD_STREAM_OP] = self._cold_stream
        for address in list(scheduler.workers):
            self.add_worker(scheduler, address)

    # -- handlers -----------------------------------------------------------------------
    async def place(self, key: str, tenant: str, gpus: float, estimate: float, priority: int = 0,
                    workers: list[str] | None = None, client: str = "", preemptible: bool = False,
                    task: str | None = None, width: int = 0, types: list[str] | None = None,
                    memory: float | None = None, warm: str | None = None, no_limit: bool = False,
                    requeue: bool = False, ran: float = 0.0) -> dict[str, Any] | None:
        """Queue one run under the client's `key`; once the policy starts it, return where:
        `{"workers": [address, ...], "devices": [[device key, ...], ...] | None, "shares": [...]}` (one entry
        per worker: a gang has several, member 0 first; `devices` None where the worker's devices are not
        known, so its allocator chooses). None if it left the queue first (`leave(key)`). One round trip per run.

        `gpus` below 1 is a fraction of one device (`memory` GB of it, default its share); whole GPUs may ask
        for `memory` GB per device; `types` restricts the device types; `width` fixes a gang's hosts. A
        `preemptible` run names the Dask key it will run under (`task`): the key a preemption stops. `warm`: the
        key of its body (dask_gpu.scheduler.warm): an idle warm body of that key takes it first, and the answer names
        it (`body`). `no_limit`, `requeue`, `ran`: its time limit (`policies.time_limits`): none declared; it
        requeues at its limit; what it already ran before a requeue.
        """
        addresses = self._addresses(workers)
        await self._known(addresses if workers else list(self.addresses))
        spec = Spec(types=tuple(t.upper() for t in types) if types else None, memory=memory,
                    share=gpus if 0 < gpus < 1 else 0.0, width=width)
        hosts = frozenset(self.addresses.index(a) for a in addresses) if workers else None
        if spec.share:
            jid = next(self.ids)
            self.keys[key] = jid
            self.answers[jid] = asyncio.get_running_loop().create_future()
            fit = self._open_fit(spec, hosts)
            job = Job(id=jid, tenant=tenant, gpus=1, submit=time.time(), estimate=estimate, priority=priority,
                      hosts=hosts, no_limit=no_limit, requeue=requeue, ran=ran)
            if warm:
                self.warm_keys[jid] = warm
            if warm and self._reuse(job, client, spec):  # an idle warm body of its key: its place, as it is
                pass
            elif fit is not None:  # a shared device has room: start now, whatever waits for whole GPUs
                self._book_start(job)
                self._start_fraction(jid, client, fit[0], fit[1], spec, job)
            else:  # it opens a device: a one-GPU run for the policy
                self.specs[jid] = spec
                self._enter(job, client)
                self._note_waiting(jid, warm)
        else:
            jid = self.enter(tenant, int(gpus), estimate, priority, workers, client, preemptible, width=width,
                             spec=spec, warm=warm, limits={"no_limit": no_limit, "requeue": requeue, "ran": ran})
            self.keys[key] = jid
        if task is not None:
            self.tasks[jid] = task
        return await self.wait(jid)

    async def run(self, key: str, tenant: str, gpus: int, estimate: float, priority: int = 0,
                  workers: list[str] | None = None, client: str = "", preemptible: bool = False,
                  task: str | None = None) -> str | list[str] | None:
        """`place` answering only the worker (a gang: the list of whole workers it holds); None if it left
        the queue first (`leave(key)`)."""
        where = await self.place(key, tenant, gpus, estimate, priority, workers, client, preemptible, task)
        if where is None:
            return None
        return where["workers"][0] if len(where["workers"]) == 1 else where["workers"]

    def _addresses(self, workers: list[str] | None) -> list[str]:
        addresses = [a for a in (self._address(w) for w in workers or []) if a is not None]
        for a in addresses:
            if a not in self.addresses:
                self.add_worker(self.scheduler, a)
        return addresses

    def enter(self, tenant: str, gpus: int, estimate: float, priority: int = 0,
              workers: list[str] | None = None, client: str = "", preemptible: bool = False, width: int = 0,
              spec: Spec | None = None, warm: str | None = None, limits: dict[str, Any] | None = None) -> int:
        """Queue one run; returns its id (then `wait` for the worker it must run on)."""
        addresses = self._addresses(workers)
        hosts = frozenset(self.addresses.index(a) for a in addresses) if workers else None
        job = Job(id=next(self.ids), tenant=tenant, gpus=gpus, submit=time.time(), estimate=estimate,
                  priority=priority, hosts=hosts, preemptible=preemptible, width=width if width > 1 else 0,
                  **(limits or {}))
        if preemptible:
            job = self._requeued(job, client)
        if spec is not None:
            self.specs[job.id] = spec
        self.answers[job.id] = asyncio.get_running_loop().create_future()
        if warm and not job.width:
            self.warm_keys[job.id] = warm
            if self._reuse(job, client, spec or Spec()):  # an idle warm body of its key: its place, as it is
                return job.id
        self._enter(job, client)
        self._note_waiting(job.id, warm if not job.width else None)
        return job.id

    def _enter(self, job: Job, client: str) -> None:
        self.answers.setdefault(job.id, asyncio.get_running_loop().create_future())
        self.waiters[job.id] = (client, job)
        self._line_up(job.id)
        self.policy.submit(job, self.state)
        self._dispatch_soon()

    def _dispatch_soon(self) -> None:
        """One dispatch for a burst of entries or ends (a .map() enters thousands in one stream batch, and its
        shards end many at a time): a pass over the queue per message would make a burst of N cost N passes of
        the scheduler's event loop."""
        if self._dispatch_pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a test driving the plugin by hand): at once
            self._dispatch()
            return
        self._dispatch_pending = True

        def run() -> None:
            self._dispatch_pending = False
            self._dispatch()

        loop.call_soon(run)

    async def wait(self, id: int) -> dict[str, Any] | None:
        """Where run `id` goes (see `place`), once the policy starts it; None if it left the queue first."""
        fut = self.answers.get(id)
        if fut is None:
            return None
        try:
            return await fut
        finally:
            self.answers.pop(id, None)

    def leave(self, id: str) -> str | None:
        """A run ended (or was abandoned while queued): free its GPUs, or take it out of the queue.

        Returns the tenant it was preempted for, if the queue stopped it (its GPUs are already free).
        """
        id = self.keys.pop(id, -1)
        self.tasks.pop(id, None)
        self.warm_keys.pop(id, None)
        preempted_for, _ = self.preempted.pop(id, (None, ""))
        if id in self.waiters:
            _, job = self.waiters.pop(id)
            self.policy.withdraw([job])
            self._answer(id, None)
        elif id in self.running:
            self._drop_running(id)
        elif id in self.fractions:
            self._end_fraction(id)
        self.specs.pop(id, None)
        self._dispatch_soon()
        return preempted_for

    def status(self, runs: bool = False) -> dict[str, Any]:
        """Counts, free GPUs per worker (by address; `names` maps each to its worker's name), tenant weights,
        preemptions so far; with `runs`, every run: those running, then those queued in the order the policy
        would serve them now."""
        out: dict[str, Any] = {"queued": self.policy.waiting(), "running": len(self.running) + len(self.fractions),
                               "free": dict(zip(self.addresses, self.state.free)),
                               "fractions": len(self.fractions),
                               "devices": {a: {d.key: ("whole" if d.whole is not None else round(d.share / UNITS, 6))
                                               for d in ds} for a, ds in self.devices.items()},
                               "weights": dict(getattr(self.policy, "weights", {})), "preempted": self.preemptions,
                               "warm": self.warm_status(), "evicted": self.evictions,
                               "estimate_factors": estimates.status() if (estimates := getattr(self.policy, "estimates",
                                                                                               None)) else {},
                               "names": {a: str(ws.name) for a, ws in self.scheduler.workers.items()}}  # what people read
        if runs:
            now = time.time()
            order = getattr(self.policy, "order", None)
            queued = list(order(now, self.state)) if order else [job for _, job in self.waiters.values()]
            out["runs"] = [
                *({"state": "running", "worker": self.addresses[r.host], "workers": [self.addresses[h] for h in r.hosts],
                   "since": r.start, **_fields(r.job)} for r, _ in self.running.values()),
                *({"state": "running", "worker": self.fractions[j][0], "workers": [self.fractions[j][0]],
                   "since": since, **_fields(job), "gpus": share} for j, (job, since, share) in self.fraction_runs.items()),
                *({"state": "queued", "worker": None, "workers": [], "since": job.submit, **_fields(job)}
                  for job in queued),
            ]
        return out

    def set_weights(self, weights: dict[str, float]) -> None:
        """Tenant weights for a weighted policy (the ClusterBlock's, as the latest flow run to start read them)."""
        if hasattr(self.policy, "weights"):
            self.policy.weights = dict(weights)
            self._dispatch()

    # -- policy -------------------------------------------------------------------------
    def _drop_running(self, jid: int, free: bool = True, finish: bool = True) -> None:
        """A run ended, was preempted or lost its worker: the policy is told it finished (with `finish`)."""
        run, _ = self.running.pop(jid)
        self.shapes.pop(jid, None)
        if finish:
            self.policy.finish([run.job], time.time())  # when it ended: the policy learns its real run time
        self._unassign(jid)
        self.specs.pop(jid, None)
        if free:
            self.state.release(run)
        else:
            self.state.running.remove(run)

    def _answer(self, jid: int, worker: dict[str, Any] | None) -> None:
        if worker is not None:
            self.meter.started(self, jid, worker)
        fut = self.answers.get(jid)
        if fut is not None and not fut.done():
            estimates = getattr(self.policy, "estimates", None)  # what it was planned on goes to its evidence
            if worker is not None and estimates is not None and (plan := estimates.plan_of(jid)) is not None:
                worker = {**worker, "plan": plan}
            fut.set_result(worker)

    def _dispatch(self) -> None:
        now = time.time()
        if self.requeue:
            self._expire_requeue(now)
        if not self.waiters:
            self.share_lines.clear()  # what they held left the queue
            return
        if self.warm:
            self._reuse_waiting()
        self._preempt(now)
        self._start_shares()  # fractions on shared devices with room: one look per shape, not per waiting run
        opened = gave_back = False
        for start in self.policy.schedule(now, self.state):
            client, job = self.waiters.pop(start.job.id)
            spec = self.specs.get(job.id, Spec())
            if spec.share and (fit := self._open_fit(spec, job.hosts)) is not None:
                # A device an earlier start of this pass opened has room (two fractions entered in one burst, after
                # the shared devices filled): it shares that one, and the policy gets back the GPU it counted.
                for h, g in start.holds:
                    self.state.free[h] += g  # (the policy counts it started: it is `finish`ed when it ends)
                self._start_fraction(job.id, client, fit[0], fit[1], self.specs.pop(job.id), job)
                gave_back = True  # a GPU this pass's policy counted taken is free: the next pass may start on it
                continue
            run = Running(start.job, start.host, now, start.gang)
            self.state.running.append(run)
            address = self.addresses[start.host]
            device = self._fresh(address, spec) if spec.share else None
            if device is not None:  # a fraction opens a device: the policy's run keeps it counted until it empties
                device.anchor = run
                self._start_fraction(job.id, client, address, device, self.specs.pop(job.id), job)
                opened = True
                continue
            self.running[job.id] = (run, client)
            if job.preemptible:
                self.shapes[job.id] = run_shape(job)
            devices, shares = self._assign(job.id, start.holds, job.gpus, spec) if not spec.share else (None, [spec.share])
            self._answer(job.id, {"workers": [self.addresses[h] for h in start.hosts], "devices": devices,
                                  "shares": shares})
        if opened:  # a fraction the policy started opened a device: fractions of a burst that waited share it now
            self._start_shares()
        if self._evict_for_waiting() or (gave_back and self.waiters):  # idle warm bodies held what runs wait for,
            self._dispatch_soon()  # or the policy's count of free GPUs grew back: the next pass places them



def _fields(job: Job) -> dict[str, Any]:
    return {"tenant": job.tenant, "gpus": job.gpus, "priority": job.priority, "estimate": job.estimate,
            "preemptible": job.preemptible}


async def _install(dask_scheduler: Any, policy: Policy | None, weights: dict[str, float] | None) -> bool:
    if PLUGIN_NAME in dask_scheduler.plugins:
        if weights is not None:
            dask_scheduler.plugins[PLUGIN_NAME].set_weights(weights)
        return False
    plugin = GPUQueuePlugin(policy)
    dask_scheduler.add_plugin(plugin, name=PLUGIN_NAME)  # no await before this line: two installs cannot race
    if weights is not None:
        plugin.set_weights(weights)
    await plugin.start(dask_scheduler)
    return True


def install_queue(client: Client, policy: Policy | None = None, weights: dict[str, float] | None = None) -> bool:
    """Put the queue on the cluster's scheduler once; later calls (other flow runs) keep the one there.

    `weights` (tenant -> weight) replace the queue's tenant weights on every call, so an edit of the
    ClusterBlock applies from the next flow run that starts.
    """
    return client.run_on_scheduler(_install, policy=policy, weights=weights)
