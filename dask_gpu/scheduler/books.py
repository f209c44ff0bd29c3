"""The queue plugin's part that keeps the policy's books with the queue's: runs that start without the policy
choosing them are counted started, and preempted runs come back as the same job (their id and first submit kept).
"""

from __future__ import annotations

import asyncio
import time

from dask_gpu.policies.interface import Job

REQUEUE_SECONDS = 600.0  # a preempted run entered again within this keeps its first submit (its client readmits it)


class PolicyBooks:
    """A mixin of GPUQueuePlugin: it works on that plugin's queue, runs and policy."""

    def _book_start(self, job: Job) -> None:
        """`job` starts without the policy choosing it (a fraction on a shared device, a warm body of its key): the
        policy's books count it started now, once (queued first if it never was), and `finish` it when it ends."""
        if self.waiters.pop(job.id, None) is None:
            self.policy.submit(job, self.state)
        self.policy.started([job], time.time())

    def _requeued(self, job: Job, client: str) -> Job:
        """A preemptible run entered again by the client of a run preempted alike (same tenant, GPUs, estimate,
        priority, width) after that one left: the policy sees the same job again, its id and first submit kept,
        so its earlier wait still counts (as the simulator requeues it)."""
        shape = run_shape(job)
        for jid, (_, c, s, old) in self.requeue.items():
            if c == client and s == shape and jid not in self.preempted:
                del self.requeue[jid]
                return Job(id=old.id, tenant=job.tenant, gpus=job.gpus, submit=old.submit, estimate=job.estimate,
                           priority=job.priority, hosts=job.hosts, preemptible=True, width=job.width)
        return job

    def _expire_requeue(self, now: float, client: str | None = None) -> None:
        """Preempted runs not entered again within `REQUEUE_SECONDS` (or whose client left) end in the policy."""
        for jid, (at, c, _, job) in list(self.requeue.items()):
            if c == client or now - at > REQUEUE_SECONDS:
                del self.requeue[jid]
                self.policy.finish([job], at)

    def _preempt(self, now: float) -> None:
        """Stop the runs the policy takes back: their GPUs are free for this pass; their workers stop them."""
        by_worker: dict[str, list[str]] = {}
        for p in self.policy.preempt(now, self.state):
            jid = p.run.job.id
            client = self.running[jid][1]
            self.preempted[jid] = (p.for_tenant, client)
            shape = self.shapes.get(jid)
            self._drop_running(jid, finish=shape is None)  # it comes back as the same job: not finished
            if shape is not None:
                self.requeue[jid] = (now, client, shape, p.run.job)
            self.preemptions += 1
            task = self.tasks.pop(jid, None)
            if task is not None:
                by_worker.setdefault(self.addresses[p.run.host], []).append(task)
        for worker, keys in by_worker.items():  # the worker's stop path, as a client's request_stop takes
            msg = {"op": "gpu_stop", "keys": keys}
            asyncio.ensure_future(self.scheduler.broadcast(msg=msg, workers=[worker], on_error="ignore"))


def run_shape(job: Job) -> tuple:
    """What a client asks of a run, to know a preempted run when it is entered again."""
    return (job.tenant, job.gpus, job.estimate, job.priority, job.width)
