"""The starvation bound: a light tenant's oldest waiting run does not wait behind a heavy tenant's backlog.

Without it, a tenant with a small share whose few runs arrive while every GPU
runs a heavy tenant's multi-hour jobs waits as long as smallest-work-first and
backfill keep filling each freed GPU with someone else's run. With
`starve_after` (seconds, 0: off), once such a tenant's oldest waiting run has
waited that long, and its tenant is light (it holds less than its quota, its
weight's part of the cluster among the tenants that run or wait now, and its
part of the waiting work is no larger than that), the run goes first and
always holds an EASY reservation (Slurm's and Maui's reservation for a starved
job; Themis bounds a tenant's wait by its lease length the same way). Nothing
then starts where it would delay it: it starts when the GPUs it reserved free
(if runs end by their planned estimates and no older starved run holds those
GPUs: by `starve_after` + the longest planned run there), not after the heavy
backlog. No run is stopped; the cost is the room the reservation holds idle and
long runs of light tenants served before short runs of others (measured in
docs/benchmarks/simulator.md, "Light tenants").
"""

from __future__ import annotations

import heapq

from dask_gpu.policies.interface import ClusterState, Job


class StarvationBound:
    """The part of `FinishTimeFair` that finds starved runs (a mixin: `quotas` is that policy's)."""

    def _open_starvation(self, after: float) -> None:
        if not after >= 0:
            raise ValueError(f"starve_after must be 0 (off) or positive seconds, not {after!r}")
        self.starve_after = after
        self.queued: dict[int, Job] = {}  # waiting runs by id, as planned now (kept only with the bound on)
        self.oldest: dict[str, list[tuple[float, int]]] = {}  # tenant -> heap of (submit, id); gone ids skipped
        self.starved_now: set[int] = set()  # the starved runs of the latest `order`
        self.work_waiting: dict[str, float] = {}  # tenant -> GPU-seconds (planned) of its waiting runs

    def _waits(self, job: Job) -> None:
        if self.starve_after:
            self.queued[job.id] = job
            self.work_waiting[job.tenant] = self.work_waiting.get(job.tenant, 0.0) + job.gpus * job.estimate
            heapq.heappush(self.oldest.setdefault(job.tenant, []), (job.submit, job.id))

    def _waits_no_more(self, job: Job) -> None:
        if self.queued.pop(job.id, None) is not None:
            self.work_waiting[job.tenant] -= job.gpus * job.estimate

    def starved(self, now: float, state: ClusterState) -> list[Job]:
        """Each light tenant's oldest waiting run once it waited `starve_after` or longer; oldest first (the order
        they are served in and reserve in). Light: it holds less than its quota, and its part of the queue's
        waiting work (GPUs x planned estimate) is at most its quota's part of the cluster, so a heavy tenant's
        backlog (which waits because it is large) is not served oldest-first instead of smallest-first."""
        if not self.starve_after:
            return []
        alloc: dict[str, float] = {}
        for r in state.running:
            alloc[r.job.tenant] = alloc.get(r.job.tenant, 0.0) + r.job.gpus
        quota = self.quotas(state)
        total = sum(self.work_waiting.values()) or 1.0
        out = []
        for tenant, heap in self.oldest.items():
            while heap and heap[0][1] not in self.queued:  # left the queue (or planned again: a newer entry)
                heapq.heappop(heap)
            if (heap and now - heap[0][0] >= self.starve_after and alloc.get(tenant, 0.0) < quota(tenant)
                    and self.work_waiting.get(tenant, 0.0) / total <= quota(tenant) / state.capacity):
                out.append(self.queued[heap[0][1]])
        return sorted(out, key=lambda j: (j.submit, j.id))
