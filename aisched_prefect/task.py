"""`@ai_task`: a Prefect task whose every execution passes admission.

The admission call *is* the task's function, so a direct call in a flow,
`.submit()`, `.map()` and `with_options()` copies all go through it; there is
no attribute to flip and no runner path that skips it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, overload

from prefect import Task
from prefect.client.schemas.objects import State, TaskRun

from aisched_prefect.errors import AdmissionDenied, ApprovalSuspended, InvalidAIRequest, NoAdmissionContext, TicketRejected
from aisched_prefect.request import AIRequest

R = TypeVar("R")

REQUEST_ATTR = "__aisched_request__"
_NEVER_RETRY = (AdmissionDenied, ApprovalSuspended, NoAdmissionContext, TicketRejected)


def request_of(task: Task[Any, Any]) -> AIRequest | None:
    """The AI request a task carries, or None for a plain Prefect task."""
    return getattr(task.fn, REQUEST_ATTR, None)


def _admit_and_run(fn: Callable[..., Any], request: AIRequest, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    from prefect.context import FlowRunContext, TaskRunContext

    from aisched_prefect.runner import AISchedTaskRunner

    flow_ctx, task_ctx = FlowRunContext.get(), TaskRunContext.get()
    runner = getattr(flow_ctx, "task_runner", None)
    if flow_ctx is None or task_ctx is None or not isinstance(runner, AISchedTaskRunner):
        raise NoAdmissionContext(
            f"AI task {fn.__name__!r} ran without admission: call it inside a flow declared with "
            "@flow(task_runner=AISchedTaskRunner(principal=..., authority=..., budget=...))"
        )
    return runner.session.run(
        fn, request, args, kwargs, task_name=task_ctx.task.name,
        task_run_id=str(task_ctx.task_run.id), flow_run_id=str(flow_ctx.flow_run.id),
        flow_name=flow_ctx.flow.name if flow_ctx.flow else None,
        flow_version=flow_ctx.flow.version if flow_ctx.flow else None,
        run_key=f"{flow_ctx.flow_run.id}/{task_ctx.task_run.task_key}",
    )


def _retry_unless_denied(user_condition: Callable[..., bool] | None) -> Callable[..., bool]:
    def condition(task: Task[Any, Any], task_run: TaskRun, state: State[Any]) -> bool:
        exc = state.result(raise_on_failure=False)
        if isinstance(exc, _NEVER_RETRY):
            return False
        return user_condition(task, task_run, state) if user_condition else True

    return condition


@overload
def ai_task(__fn: Callable[..., R], /) -> Task[..., R]: ...
@overload
def ai_task(*, kind: str, **kwargs: Any) -> Callable[[Callable[..., R]], Task[..., R]]: ...


def ai_task(
    __fn: Callable[..., Any] | None = None,
    /,
    *,
    kind: str = "inference",
    gpus: float = 0,
    gpu_memory_gb: float | None = None,
    gpu_type: str | list[str] | None = None,
    model: str | None = None,
    est_seconds: float = 0,
    est_tokens: int = 0,
    priority: int = 0,
    preemptible: bool = False,
    **task_options: Any,
) -> Any:
    """Declare an AI task: what it needs (GPUs, memory, type), what it is, what it will cost.

    `preemptible=True` lets the run borrow idle GPUs of other tenants in the
    cluster's queue (runner `queue=True`) and be stopped to give them back:
    it is charged for what ran and queued again. Make it stoppable
    (`run_subprocess`, or `checkpoint()` in Python loops) and, to lose
    nothing, resumable from its own checkpoint files.

    Other keyword arguments (name, retries, tags, ...) go to `prefect.task`.
    """
    request = AIRequest.build(
        kind=kind, gpus=gpus, gpu_memory_gb=gpu_memory_gb, gpu_type=gpu_type, model=model,
        est_seconds=est_seconds, est_tokens=est_tokens, priority=priority, preemptible=preemptible,
    )

    def decorate(fn: Callable[..., Any]) -> Task[Any, Any]:
        if inspect.iscoroutinefunction(fn):
            raise InvalidAIRequest(f"@ai_task {fn.__name__!r}: async functions are not supported yet; use `def`")

        @functools.wraps(fn)
        def admitted(*args: Any, **kwargs: Any) -> Any:
            return _admit_and_run(fn, request, args, kwargs)

        setattr(admitted, REQUEST_ATTR, request)
        options = dict(task_options)
        options["retry_condition_fn"] = _retry_unless_denied(options.get("retry_condition_fn"))
        options.setdefault("name", fn.__name__)
        return Task(fn=admitted, **options)

    return decorate(__fn) if __fn is not None else decorate
