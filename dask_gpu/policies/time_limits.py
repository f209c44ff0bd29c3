"""A declared time is a limit, as Slurm's `--time` is: when a run past it is asked to stop, and when it is ended.

One pure rule that the live control plane (`aisched_prefect.control.dispatch.time_limit`) and the simulator
(`dask_gpu.sim.simulator`) both follow, so a replay stops the same run at the same time as the live queue:

- a run that declared a limit (`est_seconds`, the default) and is still running `over_time` seconds past it
  (Slurm's `OverTimeLimit`) is asked to stop: `checkpoint()` raises `StopRequested`, `run_subprocess` sends
  SIGTERM (Slurm sends SIGTERM at the limit);
- `kill_wait` seconds later (Slurm's `KillWait`) it is ended, whatever it does; it is recorded `time-limit` and
  charged for what it ran;
- a run that asked to be requeued (`requeue_on_time_limit=True`, Slurm's `--requeue`) and stopped at its
  checkpoint is queued again with the same limit, to resume from its own checkpoint;
- a run that declared no limit (`time_limit=None`) is never stopped for time; its tenant pays for the freedom:
  it is planned on at least `no_limit_plan` seconds (as Slurm plans a job without `--time` on its partition's
  default time) and on the tenant's worst observed overrun factor (`estimates.Estimates`), and its overrun counts
  `no_limit_premium` times in its tenant's fairness books (`fairness_books.FairnessBooks.finish`), so declaring no
  limit never buys a better place than declaring an honest one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TIME_LIMIT = "time-limit"  # the outcome a run ended at its limit is recorded with


class TimeLimitError(ValueError):
    """Time-limit settings that cannot be right."""


@dataclass(frozen=True, slots=True)
class TimeLimits:
    """The operator's settings: grace past the limit before the stop (`over_time`), then before the kill
    (`kill_wait`), and the premium a no-limit run's overrun is charged at.

    >>> t = TimeLimits(over_time=60.0, kill_wait=30.0)
    >>> t.stop_at(100.0, 600.0), t.kill_at(100.0, 600.0), t.stop_at(100.0, None)
    (760.0, 790.0, inf)
    >>> t.ends(0.0, 600.0, 500.0, requeue=False), t.ends(0.0, 600.0, 5000.0, requeue=False)
    (500.0, 690.0)
    >>> t.ends(0.0, 600.0, 5000.0, requeue=True), t.ends(0.0, None, 5000.0, requeue=False)
    (660.0, 5000.0)
    >>> t.planned_no_limit(600.0), t.planned_no_limit(30000.0)
    (21600.0, 30000.0)
    """

    over_time: float = 60.0
    kill_wait: float = 30.0
    no_limit_premium: float = 2.0
    no_limit_plan: float = 6 * 3600.0

    def __post_init__(self) -> None:
        for name in ("over_time", "kill_wait"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise TimeLimitError(f"time limits: {name} must be finite seconds >= 0, not {value!r}. "
                                     f"Fix: set {name} to e.g. 60")
        if not (self.no_limit_plan >= 0 and math.isfinite(self.no_limit_plan)):
            raise TimeLimitError(f"time limits: no_limit_plan must be finite seconds >= 0, not {self.no_limit_plan!r}. "
                                 "Fix: set it to the longest run the cluster expects, e.g. 21600 (6 h)")
        if not (self.no_limit_premium >= 1 and math.isfinite(self.no_limit_premium)):
            raise TimeLimitError(f"time limits: no_limit_premium must be at least 1, not {self.no_limit_premium!r}. "
                                 "Fix: set it to e.g. 2 (a no-limit run's overrun counts twice in its tenant's rho)")

    def stop_at(self, start: float, limit: float | None) -> float:
        """When a run that started at `start` with `limit` seconds is asked to stop (inf: no limit)."""
        return math.inf if limit is None else start + limit + self.over_time

    def kill_at(self, start: float, limit: float | None) -> float:
        """When it is ended if it has not stopped by then."""
        return math.inf if limit is None else start + limit + self.over_time + self.kill_wait

    def allowed(self, limit: float | None, requeue: bool) -> float:
        """The most seconds a run may run: to its stop for one that checkpoints and requeues (it stops at the
        request), to its kill for one that does not (the simulator's model of both)."""
        if limit is None:
            return math.inf
        return limit + self.over_time + (0.0 if requeue else self.kill_wait)

    def ends(self, start: float, limit: float | None, duration: float, requeue: bool) -> float:
        """When a run that would run `duration` seconds ends under its limit."""
        return start + min(duration, self.allowed(limit, requeue))

    def planned_no_limit(self, estimate: float) -> float:
        """What a run declared with no limit is planned on at least: without a limit nothing bounds how long it
        holds its GPUs, so backfill and smallest-work-first see it as long as the cluster's default run time
        (Slurm: a job without `--time` gets its partition's DefaultTime), never shorter than what it declared."""
        return max(estimate, self.no_limit_plan)

    def planned(self, limit: float) -> float:
        """The longest a run with `limit` can hold its GPUs: what backfill may plan it on at most."""
        return limit + self.over_time + self.kill_wait
