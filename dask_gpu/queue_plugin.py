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
import time
from typing import Any

from distributed import Client
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps

from dask_gpu.cluster import _stop_keys
from dask_gpu.queue_policy import ClusterState, FairShare, Job, Policy, Running

PLUGIN_NAME = "dask-gpu-queue"


class GPUQueuePlugin(SchedulerPlugin):
    """Holds the cluster's queue of GPU runs and starts them with a pure policy (FairShare by default)."""

    name = PLUGIN_NAME

    def __init__(self, policy: Policy | None = None) -> None:
        self.policy = policy or FairShare()
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

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        scheduler.handlers["gpu_queue_run"] = self.run
        scheduler.handlers["gpu_queue_leave"] = self.leave
        scheduler.handlers["gpu_queue_status"] = self.status
        for address in list(scheduler.workers):
            self.add_worker(scheduler, address)

    # -- workers ------------------------------------------------------------------------
    def add_worker(self, scheduler: Any, worker: str) -> None:
        gpus = int(scheduler.workers[worker].resources.get("GPU", 0)) if worker in scheduler.workers else 0
        if worker in self.addresses:
            h = self.addresses.index(worker)
            self.state.free[h] = gpus - sum(r.job.gpus for r, _ in self.running.values() if r.host == h)
        else:
            self.addresses.append(worker)
            self.state.free.append(gpus)
        self._dispatch()

    def _address(self, worker: str) -> str | None:
        """A worker's address from its address or its name (inventories are keyed by name)."""
        if worker in self.scheduler.workers:
            return worker
        return next((a for a, ws in self.scheduler.workers.items() if ws.name == worker), None)

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        if worker in self.addresses:
            h = self.addresses.index(worker)
            self.state.free[h] = 0
            for jid, (run, _) in list(self.running.items()):
                if run.host == h:  # Dask reschedules or fails it; its place here is gone either way
                    self._drop_running(jid, free=False)

    # -- clients ------------------------------------------------------------------------
    def remove_client(self, scheduler: Any, client: str) -> None:
        """A client went away (its flow process died): forget what it queued and free what it ran."""
        mine = [jid for jid, (c, _) in self.waiters.items() if c == client]
        if mine:
            self.policy.remove([self.waiters[j][1] for j in mine])
            for jid in mine:
                del self.waiters[jid]
                self._answer(jid, None)
        for jid, (_, c) in list(self.running.items()):
            if c == client:
                self._drop_running(jid)
        self.preempted = {j: p for j, p in self.preempted.items() if p[1] != client}
        self.keys = {k: j for k, j in self.keys.items() if j in self.waiters or j in self.running or j in self.preempted}
        self.tasks = {j: k for j, k in self.tasks.items() if j in self.waiters or j in self.running}
        self._dispatch()

    # -- handlers -----------------------------------------------------------------------
    async def run(self, key: str, tenant: str, gpus: int, estimate: float, priority: int = 0,
                  workers: list[str] | None = None, client: str = "", preemptible: bool = False,
                  task: str | None = None) -> str | None:
        """Queue one run under the client's `key` and return the worker it must go to, once the policy
        starts it; None if it left the queue first (`leave(key)`). One round trip per run.

        A `preemptible` run names the Dask key it will run under (`task`): the key a preemption stops.
        """
        jid = self.enter(tenant, gpus, estimate, priority, workers, client, preemptible)
        self.keys[key] = jid
        if task is not None:
            self.tasks[jid] = task
        return await self.wait(jid)

    def enter(self, tenant: str, gpus: int, estimate: float, priority: int = 0,
              workers: list[str] | None = None, client: str = "", preemptible: bool = False) -> int:
        """Queue one run; returns its id (then `wait` for the worker it must run on)."""
        addresses = [a for a in (self._address(w) for w in workers or []) if a is not None]
        for a in addresses:
            if a not in self.addresses:
                self.add_worker(self.scheduler, a)
        hosts = frozenset(self.addresses.index(a) for a in addresses) if workers else None
        job = Job(id=next(self.ids), tenant=tenant, gpus=gpus, submit=time.time(), estimate=estimate,
                  priority=priority, hosts=hosts, preemptible=preemptible)
        self.answers[job.id] = asyncio.get_running_loop().create_future()
        self.waiters[job.id] = (client, job)
        self.policy.submit(job, self.state)
        self._dispatch()
        return job.id

    async def wait(self, id: int) -> str | None:
        """The worker run `id` must go to, once the policy starts it; None if it left the queue first."""
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
        preempted_for, _ = self.preempted.pop(id, (None, ""))
        if id in self.waiters:
            _, job = self.waiters.pop(id)
            self.policy.remove([job])
            self._answer(id, None)
        elif id in self.running:
            self._drop_running(id)
        self._dispatch()
        return preempted_for

    def status(self, runs: bool = False) -> dict[str, Any]:
        """Counts, free GPUs per worker, tenant weights, preemptions so far; with `runs`, every run: those
        running, then those queued in the order the policy would serve them now."""
        out: dict[str, Any] = {"queued": self.policy.waiting(), "running": len(self.running),
                               "free": dict(zip(self.addresses, self.state.free)),
                               "weights": dict(getattr(self.policy, "weights", {})), "preempted": self.preemptions}
        if runs:
            now = time.time()
            order = getattr(self.policy, "order", None)
            queued = list(order(now, self.state)) if order else [job for _, job in self.waiters.values()]
            out["runs"] = [
                *({"state": "running", "worker": self.addresses[r.host], "since": r.start, **_fields(r.job)}
                  for r, _ in self.running.values()),
                *({"state": "queued", "worker": None, "since": job.submit, **_fields(job)} for job in queued),
            ]
        return out

    def set_weights(self, weights: dict[str, float]) -> None:
        """Tenant weights for a weighted policy (the ClusterBlock's, as the latest flow run to start read them)."""
        if hasattr(self.policy, "weights"):
            self.policy.weights = dict(weights)
            self._dispatch()

    # -- policy -------------------------------------------------------------------------
    def _drop_running(self, jid: int, free: bool = True) -> None:
        run, _ = self.running.pop(jid)
        self.state.running.remove(run)
        if free:
            self.state.free[run.host] += run.job.gpus

    def _answer(self, jid: int, worker: str | None) -> None:
        fut = self.answers.get(jid)
        if fut is not None and not fut.done():
            fut.set_result(worker)

    def _dispatch(self) -> None:
        if not self.waiters:
            return
        now = time.time()
        self._preempt(now)
        for start in self.policy.schedule(now, self.state):
            client, job = self.waiters.pop(start.job.id)
            run = Running(start.job, start.host, now)
            self.state.running.append(run)
            self.running[job.id] = (run, client)
            self._answer(job.id, self.addresses[start.host])

    def _preempt(self, now: float) -> None:
        """Stop the runs the policy takes back: their GPUs are free for this pass; their workers stop them."""
        by_worker: dict[str, list[str]] = {}
        for p in self.policy.preempt(now, self.state):
            jid = p.run.job.id
            self.preempted[jid] = (p.for_tenant, self.running[jid][1])
            self._drop_running(jid)
            self.preemptions += 1
            task = self.tasks.pop(jid, None)
            if task is not None:
                by_worker.setdefault(self.addresses[p.run.host], []).append(task)
        for worker, keys in by_worker.items():  # the worker's stop path, as a client's request_stop takes
            msg = {"op": "run", "function": dumps(_stop_keys), "args": dumps((keys,)), "kwargs": dumps({}), "wait": True}
            asyncio.ensure_future(self.scheduler.broadcast(msg=msg, workers=[worker], on_error="ignore"))


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
