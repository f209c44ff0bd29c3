"""The queue policy's configuration: one object the live queue plugin and the simulator both read.

`PolicyConfig()` is the live configuration (what `GPUQueuePlugin` runs when given no policy, and what
`bench/days.py`, `bench/liar.py` and `bench/decision_speed.py` run as "ours"). An operator changes it in Dask's
config under `dask-gpu.queue-policy` (e.g. `DASK_DASK_GPU__QUEUE_POLICY__HALF_LIFE=86400` in the scheduler's
environment, or a YAML file), read when the plugin is installed; a bench changes it with `--ours name=value`.
"""

from __future__ import annotations

from typing import Any, Literal

import dask.config
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dask_gpu.policies.finish_time_fair import LIVE_HALF_LIFE, FinishTimeFair
from dask_gpu.policies.time_limits import TimeLimits

CONFIG_KEY = "dask-gpu.queue-policy"


class PolicyConfigError(ValueError):
    """The queue policy's configuration is not valid."""


class PolicyConfig(BaseModel):
    """FinishTimeFair's settings (see its docstring), and how a scheduling pass follows events."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    half_life: float | None = Field(LIVE_HALF_LIFE, gt=0, description="fairness memory halves every this many seconds")
    sharpness: float = Field(4.0, ge=0, description="how strongly a behind tenant's small jobs jump ahead")
    behind: float = Field(0.7, gt=0, description="rho above which a tenant is behind")
    overdue: float = Field(1.5, ge=0, description="a waiting job this x its alone time late goes first (0: off)")
    horizon: float = Field(6 * 3600.0, gt=0, description="time rule: tenants that submitted within it share the pool")
    tail: float = Field(1.0, ge=0, description="end-of-queue LPT: jobs this x (work left / capacity) long go first")
    tail_quiet: float = Field(3600.0, ge=0, description="time rule: the tail rule waits this long without a submit")
    reservations: int = Field(4, ge=1, description="EASY reservations per pass (the head and behind tenants)")
    align: bool = True
    learn: bool = True
    estimate_memory: float = Field(100.0, ge=1, description="runs a tenant's overrun factor remembers")
    correct_estimates: bool = True
    starve_after: float = Field(0.0, ge=0, description="starvation bound: a tenant below its quota whose oldest waiting "
                                "run has waited this many seconds gets it served first, on an EASY reservation (0: off)")
    over_time: float = Field(60.0, ge=0, description="time limits: seconds a run may pass its declared est_seconds "
                             "before it is asked to stop (Slurm's OverTimeLimit); the same as the control plane's "
                             "AISCHED_TIME_LIMIT_GRACE_SECONDS")
    kill_wait: float = Field(30.0, ge=0, description="time limits: seconds between the stop request and the end "
                             "(Slurm's KillWait); the same as AISCHED_TIME_LIMIT_KILL_WAIT_SECONDS")
    no_limit_premium: float = Field(2.0, ge=1, description="a run declared with no time limit: its overrun counts this "
                                    "many times in its tenant's rho (so no limit never beats an honest one)")
    no_limit_plan: float = Field(6 * 3600.0, ge=0, description="a run declared with no time limit is planned on at "
                                 "least this many seconds (Slurm's partition DefaultTime for a job without --time)")
    learn_down: Literal["off", "tenant", "size"] = Field("off", description="experimental: plan a tenant's limited "
                                                        "runs on what its runs take of what they declare (the median "
                                                        "of its history, never above 1): one history per tenant, or "
                                                        "per tenant and size of run; off: on the declared limit")
    batch_events: bool = Field(True, description="one pass per burst of simultaneous events, as the live plugin "
                                                 "dispatches once per event-loop turn (the simulator follows it)")

    @field_validator("learn_down", mode="before")
    @classmethod
    def _learn_down_words(cls, value: Any) -> Any:
        """`true`/`false` (as the setting was first written) mean "tenant"/"off"."""
        return {True: "tenant", False: "off", "true": "tenant", "false": "off"}.get(value, value) \
            if isinstance(value, (bool, str)) else value

    @classmethod
    def from_dask(cls, **overrides: Any) -> PolicyConfig:
        """The configuration in Dask's config (`dask-gpu.queue-policy`), with `overrides` on top."""
        found = dask.config.get(CONFIG_KEY, default=None) or {}
        values = {str(k).replace("-", "_"): v for k, v in dict(found).items()} | overrides
        try:
            return cls(**values)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise PolicyConfigError(f"queue policy settings ({CONFIG_KEY}): {problems}. Fix: correct or remove "
                                    f"those keys (see dask_gpu.policies.config.PolicyConfig)") from None

    def limits(self) -> TimeLimits:
        """The time limits these settings describe (the simulator plays them as the control plane enforces them)."""
        return TimeLimits(self.over_time, self.kill_wait, self.no_limit_premium, self.no_limit_plan)

    def build(self, weights: dict[str, float] | None = None) -> FinishTimeFair:
        """The policy these settings describe."""
        return FinishTimeFair(weights=weights, time_limits=self.limits(), **self.model_dump(
            exclude={"batch_events", "over_time", "kill_wait", "no_limit_premium", "no_limit_plan", "learn_down"}),
            learn_down=self.learn_down)
