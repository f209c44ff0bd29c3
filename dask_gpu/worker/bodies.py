"""A worker's bodies: processes that each run one run after another of one key, warm in between.

Why: a body's cost on a GPU is its set-up (importing torch, a CUDA context, gigabytes of weights), not its
arithmetic. A body forked for a run may, when the run ends, stay *warm*: it keeps its process (module state, a
loaded model), its UID and its device share, and takes the next run of the same key that the cluster's queue
sends to it, as a Ray actor or a Dask worker process keeps its state. Its key is signed in the ticket (the
tenant, the principal, the code's digest and the request): a warm body never serves another. It ends when its
keep-warm time passes idle, when the queue gives its device to another run (eviction), when the control plane
ends it (a revoked grant, a budget that cannot cover its idle time), when a run in it was stopped, or when it
died.

Each end is told to the cluster's queue (its device share is free) and, as an event, to the control plane
(`WARM_TOPIC`: how long it was idle, which the plane charges as `warm-idle`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dask_gpu.inventory import GPUDevice

logger = logging.getLogger("distributed.dask_gpu")
WARM_TOPIC = "aisched-warm-body"  # a worker's event: a warm body ended (or was refused), with its idle time
COLD_STREAM_OP = "gpu-queue-cold"  # to the scheduler, on the worker's stream: a body the queue counted as warm ended
ENDED_KEPT = 4096  # ends of idle bodies a worker remembers, for a control plane that missed their events


@dataclass(eq=False)
class BodyProcess:
    """One body's process on this worker, and what it holds."""

    tenant: str
    key: str  # the ticket's warm key ("": a body that ends after its run)
    sock: socket.socket
    pid: int
    uid: int | None = None
    devices: tuple[GPUDevice, ...] = ()
    hold: str = ""  # its key in the worker's device allocator ("": it holds no device)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    runs: int = 0
    keep: float = 0.0  # seconds it may stay idle
    idle_since: float | None = None  # monotonic; None while a run goes on
    idle_before: float = 0.0  # how long it waited before the run it took last
    cgroup: Any = None  # its cgroup (dask_gpu.isolation.cgroups), where the worker has one
    workdir: str = ""  # its working directory on the worker's host (an isolated body's), removed as it ends
    network: Any = None  # the pasta serving its network namespace (dask_gpu.isolation.network), released as it ends
    ended: str | None = None

    def idle_for(self, now: float | None = None) -> float:
        return 0.0 if self.idle_since is None else max((now or time.monotonic()) - self.idle_since, 0.0)


class BodyPool:
    """The bodies of one worker: those running a run, and the idle warm ones waiting for a run of their key.

    `end_body(body, reason, idle_seconds)` does what ending one takes on this worker (kill its processes, give its
    devices and UID back, tell the queue and the control plane); the pool only keeps the books, under one lock.
    """

    def __init__(self, end_body: Callable[[BodyProcess, str, float], None]) -> None:
        self._end_body = end_body
        self._bodies: dict[str, BodyProcess] = {}
        self._ended: deque[dict[str, Any]] = deque(maxlen=ENDED_KEPT)  # idle bodies ended here, newest last
        self._lock = threading.Lock()

    def add(self, body: BodyProcess) -> None:
        with self._lock:
            self._bodies[body.id] = body

    def take(self, body_id: str | None, key: str, devices: list[str] | None) -> tuple[BodyProcess | None, float]:
        """The idle warm body `body_id` for a run of `key` on `devices` (now busy), and how long it was idle; (None,
        0) if it is gone, busy, or not of that key and those devices (the run then starts a body of its own)."""
        if not body_id or not key:
            return None, 0.0
        with self._lock:
            body = self._bodies.get(body_id)
            if (body is None or body.ended or body.idle_since is None or body.key != key
                    or (devices is not None and sorted(devices) != sorted(d.key for d in body.devices))):
                return None, 0.0
            idle = body.idle_for()
            body.idle_since, body.idle_before = None, idle
            return body, idle

    def park(self, body: BodyProcess, keep: float) -> bool:
        """The run in `body` ended and the body stays warm for `keep` seconds; False if it was ended meanwhile."""
        with self._lock:
            if body.ended or body.id not in self._bodies:
                return False
            body.keep, body.idle_since = keep, time.monotonic()
            return True

    def end(self, body: BodyProcess, reason: str) -> bool:
        """End `body` (busy or idle); False if it had ended already."""
        with self._lock:
            if body.ended:
                return False
            body.ended = reason
            idle = body.idle_for()
            self._bodies.pop(body.id, None)
            if body.runs and body.idle_since is not None:  # a control plane that missed its event asks for it
                self._ended.append({"id": body.id, "runs": body.runs, "idle": round(idle, 3), "reason": reason,
                                    "at": time.time()})
        self._end_body(body, reason, idle)
        return True

    def end_idle(self, which: Callable[[BodyProcess], bool], reason: str) -> list[str]:
        """End the idle bodies `which` picks; their ids."""
        with self._lock:
            chosen = [b for b in self._bodies.values() if b.idle_since is not None and not b.ended and which(b)]
        return [b.id for b in chosen if self.end(b, reason)]

    def expire(self) -> list[str]:
        """End the bodies idle past their keep-warm time."""
        now = time.monotonic()
        return self.end_idle(lambda b: b.idle_for(now) >= b.keep, "keep-warm time passed")

    def idle(self) -> list[dict[str, Any]]:
        """The idle warm bodies, as the worker reports them (`aisched workers`, tests)."""
        with self._lock:
            return [{"id": b.id, "tenant": b.tenant, "devices": [d.key for d in b.devices], "runs": b.runs,
                     "idle": round(b.idle_for(), 3), "keep": b.keep} for b in self._bodies.values()
                    if b.idle_since is not None and not b.ended]

    def report(self) -> dict[str, list[dict[str, Any]]]:
        """What a control plane that was away reconciles its books with: the idle bodies and their idle periods
        (`runs`), the busy ones (how long each waited before the run it took last) and the idle bodies that ended
        here lately (at most ENDED_KEPT: how long each waited and why it ended), so each idle period is settled by
        its real length."""
        with self._lock:
            bodies = [b for b in self._bodies.values() if not b.ended and b.runs]
            return {"idle": [{"id": b.id, "runs": b.runs, "idle": round(b.idle_for(), 3)} for b in bodies
                             if b.idle_since is not None],
                    "busy": [{"id": b.id, "runs": b.runs, "idle_before": round(b.idle_before, 3)} for b in bodies
                             if b.idle_since is None],
                    "ended": list(self._ended)}

    def close(self) -> None:
        with self._lock:
            bodies = list(self._bodies.values())
        for b in bodies:
            self.end(b, "worker closing")
