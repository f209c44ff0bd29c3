"""A GPU run's declared time is its limit, as Slurm's `--time` is: the control plane stops a run past it.

The rule is `dask_gpu.policies.time_limits.TimeLimits`, the one the simulator plays: `grace` seconds past its
`est_seconds` (Slurm's OverTimeLimit: `AISCHED_TIME_LIMIT_GRACE_SECONDS`) a run is asked to stop (its body gets
SIGTERM and `checkpoint()` raises StopRequested), `kill_wait` seconds later (Slurm's KillWait:
`AISCHED_TIME_LIMIT_KILL_WAIT_SECONDS`) it is ended. Either way it is settled as `time-limit`, charged for what ran;
one declared `requeue_on_time_limit=True` is then admitted and queued again (`TimeLimitRequeue`), to resume from its
own checkpoint. Top-ups of its budget hold pay for time within the limit and the graces, never past
(`top_up_room`). A run declared `time_limit=None` is never stopped for time; the queue plans and charges it as
`time_limits` says (`time_limit_args`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from aisched_prefect.control.admission.record import Admission
from aisched_prefect.control.dispatch.running import Preempted, Running
from aisched_prefect.settings import Settings
from dask_gpu import request_stop
from dask_gpu.policies.time_limits import TIME_LIMIT, TimeLimits

logger = logging.getLogger("aisched_prefect.control")


class TimeLimitRequeue(Preempted):
    """A run that asked `requeue_on_time_limit=True` stopped at its limit: charged for what ran, queued again."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds  # what this attempt ran
        super().__init__(f"stopped at its time limit after {seconds:.1f}s; queued again")


def limits(settings: Settings) -> TimeLimits:
    """The operator's time-limit settings as the shared rule."""
    return TimeLimits(over_time=settings.time_limit_grace_seconds, kill_wait=settings.time_limit_kill_wait_seconds)


def time_limit_args(adm: Admission, ran: float = 0.0) -> dict[str, Any]:
    """What the cluster's queue is told of a run's limit (nothing for the default: its estimate is its limit)."""
    req, out = adm.request, {}
    if req.gpus and req.time_limit is None:
        out["no_limit"] = True
    if req.requeue_on_time_limit:
        out["requeue"] = True
    if ran:
        out["ran"] = ran
    return out


def top_up_room(r: Running, extra: float, settings: Settings) -> float:
    """How much of a top-up of `extra` seconds a run may take: time within its limit and the graces, never past."""
    limit = r.admission.request.limit_seconds
    if limit is None:
        return extra
    return max(0.0, min(extra, limits(settings).planned(limit) - r.covered_seconds))


def stop_reply(adm: Admission, seconds: float, settings: Settings) -> dict[str, str]:
    """What the flow is told of a run ended at its limit (a `Reply`'s fields)."""
    req = adm.request
    return {"reason": (f"the task ran past its time limit (est_seconds {req.est_seconds:g}s + "
                       f"{settings.time_limit_grace_seconds:g}s grace): it was asked to stop, ended, and charged for "
                       f"the {seconds:.1f}s it ran"),
            "error_message": (f"stopped: time limit (est_seconds {req.est_seconds:g}s). Fix: declare est_seconds that "
                              "covers the run, have it checkpoint and declare requeue_on_time_limit=True, or declare "
                              "time_limit=None"),
            "error_type": "dask_gpu.errors.StopRequested"}


class TimeLimitWatch:
    """Called by the watcher each poll: asks runs past their limit to stop, and ends those past the kill wait."""

    def __init__(self, dispatcher: Any, settings: Settings) -> None:
        self.dispatcher, self.settings = dispatcher, settings
        self.rule = limits(settings)
        self.killed: set[str] = set()  # keys already ended (asked once)
        self._lock = threading.Lock()

    def check(self, running: dict[str, Running], now: float | None = None) -> list[str]:
        """One poll over `running` (monotonic `now`); the keys asked to stop or ended in it."""
        now = time.monotonic() if now is None else now
        soft, hard = [], []
        with self._lock:
            for key, r in running.items():
                limit = r.admission.request.limit_seconds
                if limit is None or r.started_at is None or r.settled:
                    continue
                if r.stop_reason is None and now >= self.rule.stop_at(r.started_at, limit):
                    with self.dispatcher.lock:
                        if r.stop_reason is not None:
                            continue
                        r.stop_reason = TIME_LIMIT
                    soft.append(key)
                elif (r.stop_reason == TIME_LIMIT and key not in self.killed
                      and now >= self.rule.kill_at(r.started_at, limit)):
                    self.killed.add(key)
                    hard.append(key)
            self.killed.intersection_update(running)  # (settled runs leave the set)
        for keys, gentle in ((soft, True), (hard, False)):
            if keys:
                dask_keys = [k for key in keys for k in running[key].dask_keys]
                request_stop(self.dispatcher.client, dask_keys, soft=gentle)
                logger.warning("%s %d AI task(s) past their time limit: %s", "asked to stop" if gentle else "ended",
                               len(keys), ", ".join(running[k].admission.task_name for k in keys))
        return soft + hard
