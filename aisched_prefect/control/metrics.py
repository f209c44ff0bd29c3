"""The control plane's Prometheus metrics: what an operator of a shared GPU cluster watches, in Prometheus's names.

Most figures are read from the plane's own state when Prometheus scrapes (`PlaneState`, a custom collector): runs
waiting and running per tenant and GPU type, holds and posted spend per budget line against its limit, approvals
pending and their age, evidence records, whether the Dask scheduler answers. What only exists as it happens is
counted by wrapping the parts that decide it (`instrument`), not by edits in their hot paths: admissions by outcome
and phase, denials by reason (the phase that refused: a bounded set, never the free text), decision and admission
latency, ledger commit latency. The queue's own figures come from the Dask scheduler at scrape time
(dask_gpu/scheduler/metrics.py), served on a path of their own so Prometheus sees the scheduler down as `up == 0`.

No metric carries a task key, a task run id, an argument, a token or a principal's secret: labels are tenants,
GPU types, budget lines, phases and states.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from functools import wraps
from typing import Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from aisched_prefect.errors import AdmissionDenied

logger = logging.getLogger("aisched_prefect.control")

PHASES = ("configuration", "feasibility", "pricing", "authority", "approval", "budget", "record")
"""The phases an admission ends in (AdmissionDenied's stages, and `record` for an admission)."""
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
QUEUE_FETCH_SECONDS = 5.0  # a scrape of the queue waits this long for the scheduler, then says it is down


class PlaneMetrics:
    """One control plane's registry: its counters and histograms, its state collector, its exposition."""

    def __init__(self, plane: Any) -> None:
        self.plane = plane
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.admissions = Counter("aisched_admissions", "Admission passes by how they ended (admitted, denied, "
                                  "waiting for a person) and the phase they ended in.", ["outcome", "phase"], registry=r)
        self.denials = Counter("aisched_denials", "Admissions denied, by the phase whose check refused them.",
                               ["reason"], registry=r)
        self.decision = Histogram("aisched_decision_seconds", "Seconds one admission pass (phases 0-6) took.",
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.admission = Histogram("aisched_admission_seconds", "Seconds from a call's arrival to its answer "
                                   "(accepted and handed to the queue, denied, or waiting for a person).",
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.commit = Histogram("aisched_ledger_commit_seconds", "Seconds a ledger write waited for its group "
                                "commit (what every hold, settlement and evidence record costs).",
                                buckets=LATENCY_BUCKETS, registry=r)
        for phase in PHASES[:-1]:  # every series exists from the start: rate() and increase() see the first one
            self.admissions.labels("denied", phase)
            self.denials.labels(phase)
        self.admissions.labels("admitted", "record")
        self.admissions.labels("waiting", "approval")
        r.register(PlaneState(plane))
        self.queue = QueueRegistry(plane)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class QueueRegistry:
    """The queue's figures, fetched from the Dask scheduler when scraped (None without a queue)."""

    def __init__(self, plane: Any) -> None:
        from dask_gpu.scheduler.metrics import QueueCollector

        self.plane = plane
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(QueueCollector(self._fetch))

    def _fetch(self) -> dict[str, Any]:
        client = self.plane.client
        return client.sync(client.scheduler.gpu_queue_metrics, callback_timeout=QUEUE_FETCH_SECONDS)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _timed(histogram: Histogram, fn: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            histogram.observe(time.perf_counter() - started)
    return timed


def instrument(plane: Any, metrics: PlaneMetrics) -> None:
    """Count what happens by wrapping the plane's parts where it is decided (their own code stays as it is)."""
    from aisched_prefect.control.admission.record import Admission

    run = plane.pipeline.run

    @wraps(run)
    def counted_run(*args: Any, **kwargs: Any) -> Any:  # whatever the pipeline's run takes, passed on as it is
        started = time.perf_counter()
        try:
            got = run(*args, **kwargs)
        except AdmissionDenied as exc:
            stage = exc.stage if exc.stage in PHASES else "other"
            metrics.admissions.labels("denied", stage).inc()
            metrics.denials.labels(stage).inc()
            raise
        finally:
            metrics.decision.observe(time.perf_counter() - started)
        metrics.admissions.labels(*(("admitted", "record") if isinstance(got, Admission) else ("waiting", "approval"))).inc()
        return got

    plane.pipeline.run = counted_run
    plane.runs.submit = _timed(metrics.admission, plane.runs.submit)
    commits = plane.ledger._commits  # every write of the ledger goes through its group commit
    commits.write = _timed(metrics.commit, commits.write)


class PlaneState:
    """A custom collector: the plane's state, read when Prometheus scrapes (nothing counted on the hot path)."""

    def __init__(self, plane: Any) -> None:
        self.plane = plane

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        plane = self.plane
        info = InfoMetricFamily("aisched_plane", "The control plane answering this scrape.")
        info.add_metric([], {"version": str(plane.version)})
        yield info
        up = GaugeMetricFamily("aisched_scheduler_up", "1 while the plane's Dask scheduler answers, else 0.")
        up.add_metric([], 1.0 if plane.scheduler.status()["connected"] else 0.0)
        yield up
        yield from _runs(plane)
        yield from _budgets(plane)
        yield from _approvals(plane)
        yield from _evidence(plane)


def _runs(plane: Any) -> Iterator[Any]:
    counts: dict[tuple[str, str, str], int] = {}
    dispatcher = plane.dispatcher
    with dispatcher.lock:
        running = list(dispatcher.running.values())
    for r in running:
        gpu_type = r.admission.request.gpu_type
        gpu_type = ",".join(gpu_type) if isinstance(gpu_type, tuple) else (gpu_type or "any")
        state = "running" if (r.placed or r.started_at is not None) else "waiting"
        key = (state, r.admission.tenant, gpu_type)
        counts[key] = counts.get(key, 0) + 1
    family = GaugeMetricFamily("aisched_runs", "Admitted runs this plane follows: waiting for their place in the "
                               "queue, or running.", labels=["state", "tenant", "gpu_type"])
    for (state, tenant, gpu_type), n in sorted(counts.items()):
        family.add_metric([state, tenant, gpu_type], n)
    yield family


def _budgets(plane: Any) -> Iterator[Any]:
    labels = ["budget", "period", "unit"]
    limit = GaugeMetricFamily("aisched_budget_limit", "Each budget line's limit.", labels=labels)
    held = GaugeMetricFamily("aisched_budget_held", "Held on the budget line (runs admitted, not yet settled).",
                             labels=labels)
    posted = GaugeMetricFamily("aisched_budget_posted", "Posted spend on the budget line (settled runs).",
                               labels=labels)
    for a in plane.ledger.accounts():
        values = [str(a["budget"]), str(a["period"]), str(a["unit"])]
        limit.add_metric(values, float(a["limit"]))
        held.add_metric(values, float(a["pending"]))
        posted.add_metric(values, float(a["posted"]))
    yield from (limit, held, posted)


def _approvals(plane: Any) -> Iterator[Any]:
    from aisched_prefect.control.approvals.requests import approvals

    now = time.time()
    with plane.ledger.reader.connect() as conn:
        rows = conn.execute(sa.select(approvals.c.deadline, approvals.c.view)
                            .where(approvals.c.status == "pending")).all()
    ages, lefts = [], []
    for deadline, view in rows:
        if deadline <= now:
            continue
        timeout = float((json.loads(view) if isinstance(view, str) else view).get("timeout_seconds", 0))
        ages.append(max(now - (deadline - timeout), 0.0))
        lefts.append(deadline - now)
    pending = GaugeMetricFamily("aisched_approvals_pending", "Requests waiting for a person's answer.")
    pending.add_metric([], len(ages))
    yield pending
    age = GaugeMetricFamily("aisched_approval_oldest_age_seconds", "How long the oldest pending request has waited "
                            "(0: none pending).")
    age.add_metric([], max(ages, default=0.0))
    yield age
    left = GaugeMetricFamily("aisched_approval_next_deadline_seconds", "Seconds until the soonest pending request "
                             "times out, denied (absent: none pending).")
    if lefts:
        left.add_metric([], min(lefts))
    yield left


def _evidence(plane: Any) -> Iterator[Any]:
    from aisched_prefect.ledger import chain_head

    with plane.ledger.reader.connect() as conn:
        seq = conn.execute(sa.select(sa.func.max(chain_head.c.seq))).scalar()
    yield CounterMetricFamily("aisched_evidence_records", "Evidence records in the hash-chained log.",
                              value=float(seq or 0))
