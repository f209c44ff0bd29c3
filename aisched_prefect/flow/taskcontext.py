"""The Prefect context an AI task's run sees: the runner that admits it, and Prefect's view of the sync task.

Kept apart from `task` (the decorator) and `runner` (the task runner) so that neither imports the other's module to
find its counterpart: the runner is recognised by the `AdmittingRunner` base it has, and the session (which runs the
call) reaches `as_sync` here.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
from collections.abc import Callable
from typing import Any, TypeVar

from aisched_prefect.errors import NoAdmissionContext
from aisched_prefect.logs import quiet_expected_outcomes

R = TypeVar("R")

# The `.map()` being submitted (its id, its size where known, a counter of its shards): set by the runner's `map`.
MAPPING: contextvars.ContextVar[tuple[str, int | None, itertools.count] | None] = contextvars.ContextVar(
    "aisched_mapping", default=None)
# The shard of a `.map()` an AI task run is (the map's id, this shard's index, the map's size): set per submitted run.
MAP_SHARD: contextvars.ContextVar[tuple[str, int, int | None] | None] = contextvars.ContextVar(
    "aisched_map_shard", default=None)


class AdmittingRunner:
    """What a task runner is to an AI task: the holder of the flow run's session with the control plane
    (`AISchedTaskRunner` is one; an AI task run under any other runner is refused)."""

    @property
    def session(self) -> Any:
        raise NotImplementedError


def call_context(fn: Callable[..., Any]) -> tuple[Any, dict[str, Any]]:
    """The runner of the flow run this call belongs to, and what the control plane is told of the call."""
    from prefect.context import FlowRunContext, TaskRunContext

    flow_ctx, task_ctx = FlowRunContext.get(), TaskRunContext.get()
    runner = getattr(flow_ctx, "task_runner", None)
    if flow_ctx is None or task_ctx is None or not isinstance(runner, AdmittingRunner):
        quiet_expected_outcomes()  # the script ends on this one line, not on Prefect's traceback
        raise NoAdmissionContext(
            f"AI task {fn.__name__!r} ran without admission (outside a flow, or under another task runner, such as "
            "Prefect's default). Fix: call it inside a flow declared with "
            "@flow(task_runner=AISchedTaskRunner(principal=..., authority=..., budget=...))"
        )
    quiet_expected_outcomes()
    shard = MAP_SHARD.get()
    array = (None if shard is None else
             {"id": shard[0], "index": shard[1], "size": shard[2], "name": str(task_ctx.task_run.name)[:200]})
    return runner, dict(array=array, 
        task_name=task_ctx.task.name, task_run_id=str(task_ctx.task_run.id), flow_run_id=str(flow_ctx.flow_run.id),
        flow_name=flow_ctx.flow.name if flow_ctx.flow else None,
        run_key=f"{flow_ctx.flow_run.id}/{task_ctx.task_run.task_key}",
        deployment=bool(flow_ctx.flow_run.deployment_id), attempt=max(task_ctx.task_run.run_count, 1))


SYNC_TASK_ATTR = "aisched_sync_task"


def as_sync(fn: Callable[..., R]) -> Callable[..., R]:
    """`fn`, to be called in a thread on behalf of an AI task run that waits as a coroutine, with Prefect seeing
    the task as the sync one it is (Prefect's sync/async dispatch reads the running task's `isasync`: under the
    async twin, `Block.load` or `pause_flow_run` would return coroutines)."""
    from prefect.context import TaskRunContext

    ctx = TaskRunContext.get()
    original = getattr(getattr(ctx, "task", None), SYNC_TASK_ATTR, None)
    if ctx is None or original is None:
        return fn

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> R:
        with ctx.model_copy(update={"task": original}):
            return fn(*args, **kwargs)

    return run
