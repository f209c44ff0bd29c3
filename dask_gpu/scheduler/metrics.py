"""The cluster queue's Prometheus metrics: what its operators watch (waiting per tenant, how long runs wait, devices
allocated and idle, each tenant's finish-time fairness, warm bodies).

Two halves, because the queue lives in the Dask scheduler and Prometheus scrapes an HTTP endpoint elsewhere:

- `QueueMeter`, kept by the queue plugin: the one thing that must be counted as it happens (each start's wait, into
  a per-tenant histogram); everything else is read from the plugin's books when asked (`snapshot`), never counted
  on the hot path.
- `QueueCollector`, a `prometheus_client` custom collector: turns a snapshot (fetched at scrape time, e.g. over the
  control plane's Dask client) into metric families.

A snapshot carries tenants, counts and times only: never a task key, an argument or a worker's secret.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator
from typing import Any

WAIT_BUCKETS: tuple[float, ...] = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 12 * 3600.0, 86400.0)
"""Seconds a run waited in the queue before it started (Kueue's admission wait buckets, stretched to a day)."""


class QueueMeter:
    """Per-tenant wait-time histograms (cumulative, as Prometheus wants them) and the runs started in a reused warm
    body; fed by the plugin at each start, read by `snapshot`."""

    def __init__(self) -> None:
        self.waits: dict[str, list[float]] = {}  # tenant -> [count per bucket (+Inf last), sum]
        self.warm_runs: set[int] = set()  # job ids started in an idle warm body (busy while they run)

    def started(self, plugin: Any, jid: int, answer: dict[str, Any]) -> None:
        """A run was answered its place: how long it waited goes to its tenant's histogram (once per start)."""
        job = _job_of(plugin, jid)
        if job is None:
            return
        waited = max(time.time() - job.submit, 0.0)
        counts = self.waits.setdefault(job.tenant, [0.0] * (len(WAIT_BUCKETS) + 2))
        counts[bisect.bisect_left(WAIT_BUCKETS, waited)] += 1
        counts[-1] += waited
        if answer.get("body"):
            self.warm_runs.add(jid)


def _job_of(plugin: Any, jid: int) -> Any:
    if jid in plugin.running:
        return plugin.running[jid][0].job
    ran = plugin.fraction_runs.get(jid)
    return ran[0] if ran is not None else None


def snapshot(plugin: Any) -> dict[str, Any]:
    """The queue's figures now, from the plugin's own books (what `gpu_queue_metrics` answers)."""
    now = time.time()
    meter: QueueMeter = plugin.meter
    waiting: dict[str, int] = {}
    oldest: dict[str, float] = {}
    for _, job in list(plugin.waiters.values()):
        waiting[job.tenant] = waiting.get(job.tenant, 0) + 1
        oldest[job.tenant] = max(oldest.get(job.tenant, 0.0), now - job.submit)
    running: dict[str, float] = {}
    for run, _ in list(plugin.running.values()):
        running[run.job.tenant] = running.get(run.job.tenant, 0) + run.job.gpus
    for job, _, share in list(plugin.fraction_runs.values()):
        running[job.tenant] = running.get(job.tenant, 0) + share
    allocated = idle = 0
    for devices in plugin.devices.values():
        for d in devices:
            if d.whole is not None or d.share > 0:
                allocated += 1
            else:
                idle += 1
    if not plugin.devices:  # no device learned (a declared inventory): the policy's GPU counts
        idle = int(sum(plugin.state.free))
        allocated = int(sum(r.job.gpus for r in plugin.state.running))
    policy = plugin.policy
    rho = {}
    if hasattr(policy, "rho"):
        for tenant in set(getattr(policy, "alone_sum", {})) | set(waiting):
            try:
                rho[tenant] = float(policy.rho(tenant, now))
            except (KeyError, ZeroDivisionError):
                continue
    meter.warm_runs &= set(plugin.running) | set(plugin.fractions)  # ended runs leave the busy set here
    return {"waiting": waiting, "oldest_wait": oldest, "running_gpus": running,
            "devices": {"allocated": allocated, "idle": idle},
            "warm": {"idle": len(getattr(plugin, "warm", {})), "busy": len(meter.warm_runs)},
            "fairness": rho, "preemptions": plugin.preemptions,
            "waits": {t: list(c) for t, c in meter.waits.items()}, "buckets": list(WAIT_BUCKETS)}


class QueueCollector:
    """A `prometheus_client` collector over `fetch()` (a `snapshot`, fetched at scrape time)."""

    def __init__(self, fetch: Callable[[], dict[str, Any]]) -> None:
        self.fetch = fetch

    def describe(self) -> list[Any]:
        return []  # nothing fetched at registration: the scheduler may not answer yet

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        snap = self.fetch()
        waiting = GaugeMetricFamily("aisched_queue_waiting", "Runs waiting in the cluster's queue.", labels=["tenant"])
        for tenant, n in sorted(snap["waiting"].items()):
            waiting.add_metric([tenant], n)
        yield waiting
        oldest = GaugeMetricFamily("aisched_queue_oldest_wait_seconds",
                                   "How long the tenant's longest-waiting queued run has waited.", labels=["tenant"])
        for tenant, s in sorted(snap["oldest_wait"].items()):
            oldest.add_metric([tenant], s)
        yield oldest
        running = GaugeMetricFamily("aisched_queue_running_gpus", "GPUs held by the tenant's running runs.",
                                    labels=["tenant"])
        for tenant, g in sorted(snap["running_gpus"].items()):
            running.add_metric([tenant], g)
        yield running
        devices = GaugeMetricFamily("aisched_queue_devices", "GPU devices the queue places on, by state.",
                                    labels=["state"])
        for state, n in sorted(snap["devices"].items()):
            devices.add_metric([state], n)
        yield devices
        warm = GaugeMetricFamily("aisched_queue_warm_bodies", "Warm bodies: idle (holding devices, waiting for a run "
                                 "of their key) and busy (running a run they were reused for).", labels=["state"])
        for state, n in sorted(snap["warm"].items()):
            warm.add_metric([state], n)
        yield warm
        fair = GaugeMetricFamily("aisched_queue_fairness_rho", "Each tenant's finish-time fairness (its runs' "
                                 "completion times over those of its fair share alone; 1 is fair, above is behind).",
                                 labels=["tenant"])
        for tenant, r in sorted(snap["fairness"].items()):
            fair.add_metric([tenant], r)
        yield fair
        yield CounterMetricFamily("aisched_queue_preemptions", "Runs preempted to give borrowed GPUs back.",
                                  value=snap["preemptions"])
        hist = HistogramMetricFamily("aisched_queue_wait_seconds", "Seconds a run waited in the queue before it "
                                     "started.", labels=["tenant"])
        bounds = [*snap["buckets"], float("inf")]
        for tenant, counts in sorted(snap["waits"].items()):
            cumulative, acc = [], 0.0
            for bound, n in zip(bounds, counts[:-1]):
                acc += n
                cumulative.append((_le(bound), acc))
            hist.add_metric([tenant], cumulative, sum_value=counts[-1])
        yield hist


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))
