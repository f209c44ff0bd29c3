"""`@ai_task`: a Prefect task whose every execution passes admission.

The admission call *is* the task's function, so a direct call in a flow,
`.submit()`, `.map()` and `with_options()` copies all go through it; there is
no attribute to flip and no runner path that skips it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, overload

from prefect import Task
from prefect.client.schemas.objects import State, TaskRun

from aisched_prefect.errors import AdmissionDenied, InvalidAIRequest, NoAdmissionContext
from aisched_prefect.flow.approval_wait import ApprovalSuspended
from dask_gpu.errors import TicketRejected
from aisched_prefect.request import AIRequest
from aisched_prefect.flow.taskcontext import SYNC_TASK_ATTR, as_sync, call_context

R = TypeVar("R")

REQUEST_ATTR = "__aisched_request__"
BODY_ATTR = "__aisched_body__"
_NEVER_RETRY = (AdmissionDenied, ApprovalSuspended, NoAdmissionContext, TicketRejected)


def request_of(task: Task[Any, Any]) -> AIRequest | None:
    """The AI request a task carries, or None for a plain Prefect task."""
    return getattr(task.fn, REQUEST_ATTR, None)


def _admit_and_run(fn: Callable[..., Any], request: AIRequest, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    runner, call = call_context(fn)
    return runner.session.run(fn, request, args, kwargs, **call)


async def _admit_and_run_async(fn: Callable[..., Any], request: AIRequest, args: tuple[Any, ...],
                               kwargs: dict[str, Any]) -> Any:
    """The same admission, as a coroutine: how a submitted or mapped run waits (no thread of its own)."""
    import asyncio

    runner, call = call_context(fn)
    session = await asyncio.to_thread(as_sync(lambda: runner.session))  # the first call may start an embedded plane
    return await session.run_async(fn, request, args, kwargs, **call)


def async_twin(task: Task[Any, Any]) -> Task[Any, Any]:
    """The same AI task, with a coroutine for its function: what the runner's `submit` runs on its loop, so
    Prefect's async task engine keeps states, retries and results while the run waits as a coroutine."""
    import copy

    body, request = getattr(task.fn, BODY_ATTR), request_of(task)
    assert request is not None

    async def admitted(*args: Any, **kwargs: Any) -> Any:
        return await _admit_and_run_async(body, request, args, kwargs)

    _like(admitted, body)
    setattr(admitted, REQUEST_ATTR, request)
    setattr(admitted, BODY_ATTR, body)
    twin = copy.copy(task)
    twin.fn = admitted
    twin.isasync = True
    setattr(twin, SYNC_TASK_ATTR, task)
    return twin


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
    hosts: int | None = None,
    keep_warm: float | timedelta | None = None,
    keep_warm_across_flow_runs: bool = False,
    time_limit: str | None = "est_seconds",
    requeue_on_time_limit: bool = False,
    **task_options: Any,
) -> Any:
    """Declare an AI task: what it needs (GPUs, memory, type), what it is, what it will cost.

    A run wider than every worker (`gpus=16` on 8-GPU workers), or with
    `hosts=N`, is a multi-host job: one admission, on whole workers all at once,
    its body run once per host with the rendezvous environment torchrun reads
    (`dask_gpu.torchrun_args`); the flow gets member 0's return value.

    `preemptible=True` lets the run borrow idle GPUs of other tenants in the
    cluster's queue and be stopped to give them back:
    it is charged for what ran and queued again. Make it stoppable
    (`run_subprocess`, or `checkpoint()` in Python loops) and, to lose
    nothing, resumable from its own checkpoint files.

    `keep_warm` (seconds or a `timedelta`): how long a run's body process may wait, warm, for the next run of
    this task by the same principal with the same request, keeping its module state (a model loaded at module
    level or in a callable class's `__init__`), its device share and its UID; its idle time is charged as
    `warm-idle`. Default: 5 minutes for kinds `inference`, `batch-inference` and `embedding`, else 0 (a fresh
    process per run). A class with `__call__` may be decorated too: constructed once per body, called per run.
    A body ends as soon as nothing of its key waits in its own flow run (after `AISCHED_WARM_LINGER_SECONDS`, 2 s),
    so a map's idle time is the tail of its work; `keep_warm_across_flow_runs=True` keeps it its whole `keep_warm`
    time for the next flow run too.

    A GPU run's `est_seconds` is its time limit, as Slurm's `--time` is: past it and the operator's grace
    (`AISCHED_TIME_LIMIT_GRACE_SECONDS`, Slurm's OverTimeLimit) `checkpoint()` raises StopRequested (and its body gets
    SIGTERM); `AISCHED_TIME_LIMIT_KILL_WAIT_SECONDS` later it is ended, recorded `time-limit` and charged for what
    ran. `requeue_on_time_limit=True` (Slurm's `--requeue`): it is then queued again, to resume from its own
    checkpoint files. `time_limit=None` (or "unlimited"): no limit; the queue plans it on its tenant's worst observed
    overrun and charges its overrun at a premium in fairness.

    Other keyword arguments (name, retries, tags, ...) go to `prefect.task`.
    """
    request = AIRequest.build(
        kind=kind, gpus=gpus, gpu_memory_gb=gpu_memory_gb, gpu_type=gpu_type, model=model,
        est_seconds=est_seconds, est_tokens=est_tokens, priority=priority, preemptible=preemptible, hosts=hosts,
        keep_warm=keep_warm, keep_warm_across_flow_runs=keep_warm_across_flow_runs,
        time_limit=time_limit, requeue_on_time_limit=requeue_on_time_limit,
    )

    def decorate(fn: Callable[..., Any]) -> Task[Any, Any]:
        if isinstance(fn, type) and not any("__call__" in vars(c) for c in fn.__mro__[:-1]):
            raise InvalidAIRequest(f"@ai_task class {fn.__name__!r} has no __call__: a callable class is constructed "
                                   "once per warm body and called per run; define __call__(self, ...)")
        if inspect.iscoroutinefunction(fn.__call__ if isinstance(fn, type) else fn):
            raise InvalidAIRequest(f"@ai_task {fn.__name__!r}: async functions are not supported yet; use `def`")
        options = dict(task_options)
        options["retry_condition_fn"] = _retry_unless_denied(options.get("retry_condition_fn"))
        options.setdefault("name", fn.__name__)
        return AITask(fn=_admitted(fn, request), **options)

    return decorate(__fn) if __fn is not None else decorate


REQUEST_FIELDS = tuple(AIRequest.model_fields)


def _like(wrapper: Callable[..., Any], body: Any) -> None:
    """`wrapper` named and signed as the body it admits: a function's own, a callable class's `__call__`."""
    from aisched_prefect.approvals import call_signature

    if isinstance(body, type):
        functools.update_wrapper(wrapper, body, updated=())  # a class's __dict__ is its methods: not copied
        wrapper.__signature__ = call_signature(body)  # type: ignore[attr-defined]
    else:
        functools.update_wrapper(wrapper, body)


def _admitted(fn: Callable[..., Any], request: AIRequest) -> Callable[..., Any]:
    """The task's function: every call of it is admitted with `request`."""

    def admitted(*args: Any, **kwargs: Any) -> Any:
        return _admit_and_run(fn, request, args, kwargs)

    _like(admitted, fn)
    setattr(admitted, REQUEST_ATTR, request)
    setattr(admitted, BODY_ATTR, fn)
    return admitted


class AITask(Task):  # type: ignore[type-arg]
    """A Prefect task whose calls are admitted; `with_options` also takes what it asks for.

    >>> @ai_task(gpus=1, kind="training", est_seconds=60)
    ... def train(cfg): ...
    >>> request_of(train.with_options(gpus=4, est_seconds=600)).gpus
    4.0
    """

    def with_options(self, **options: Any) -> Task[Any, Any]:
        asked = {k: options.pop(k) for k in list(options) if k in REQUEST_FIELDS}
        copy = super().with_options(**options)
        copy.__class__ = type(self)  # Prefect builds a plain Task; the copy stays one whose options take requests
        if not asked:
            return copy
        current = request_of(self)
        assert current is not None
        request = AIRequest.build(**{**current.model_dump(), **asked})
        copy.fn = _admitted(getattr(self.fn, BODY_ATTR), request)
        return copy
