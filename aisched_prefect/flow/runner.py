"""AISchedTaskRunner: Prefect's thread-pool runner, with every AI task admitted and run by the control plane.

Task orchestration (states, retries, results) stays in the flow process, as
with `ThreadPoolTaskRunner`; each AI task call becomes one request to the
control plane, which admits it, runs its body on a GPU worker and settles it.
Plain `@task` tasks run in the flow process's threads exactly as under
`ThreadPoolTaskRunner`.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import ValidationError

from aisched_prefect.flow.config import REFUSED, RunnerConfig
from aisched_prefect.errors import ConfigurationError, NoAdmissionContext
from aisched_prefect.flow.session import RunnerSession
from aisched_prefect.flow.signals import WHY, StopSignals
from aisched_prefect.flow.stream import LoopThread
from aisched_prefect.flow.taskcontext import MAP_SHARD, MAPPING, AdmittingRunner


class AISchedTaskRunner(ThreadPoolTaskRunner, AdmittingRunner):
    """Admit every AI task at the control plane (authority, budget, approval) and run it on a GPU worker.

    Args:
        principal: who this flow acts as, e.g. "team-a/nightly". With a control plane
            configured, the credential decides; this may only repeat it.
        authority: name of an AuthorityBlock. With a control plane configured the credential
            names it (an operator applied it); with none, the runner starts an embedded control
            plane that applies this block.
        budget: name of a BudgetBlock (as `authority`).
        approval_policy: name of an ApprovalPolicyBlock (as `authority`); None: nobody is asked.
        cluster: name of a ClusterBlock with model-call limits and tenant weights (as `authority`).
        grant: id of the grant this flow acts under (one issued or delegated to its
            principal); None: the first of its grants that covers the run.
        approver: "pause" (a person answers at the control plane; the flow run pauses
            meanwhile, a deployment run is suspended) or "policy" (nobody is asked).
        declared: declared GPU inventory for an embedded control plane's local cluster.
        max_workers: flow-process threads that run task engines.
        tenant: who pays (embedded control plane only); None: the principal up to its first '/'.
        approval_hook: called with each ApprovalView when a person is asked (a callable),
            or sent it as JSON (an http(s) URL): for teams that approve from chat.
        queue: embedded control plane only: every GPU run waits in the cluster's one fair-share queue (the
            default); False hands runs to Dask directly (no fairness, no gang placement through the queue).
        control_plane: URL(s) of `aisched serve` (else AISCHED_CONTROL_PLANE).
        credential: the token an operator issued (else AISCHED_TOKEN).
    """

    def __init__(self, principal: str | None = None, authority: Any = None, budget: Any = None,
                 grant: str | None = None, approval_policy: Any = None, approver: str = "pause",
                 declared: str | None = None, max_workers: int | None = None, tenant: str | None = None,
                 approval_hook: Any = None, cluster: Any = None, queue: bool = True,
                 control_plane: str | None = None, credential: str | None = None, **refused: Any) -> None:
        for name in refused:
            if name in REFUSED:
                raise ConfigurationError(f"AISchedTaskRunner({name}=...) is refused: {REFUSED[name]}")
            raise TypeError(f"AISchedTaskRunner got an unexpected argument {name!r}")
        try:
            self._config = RunnerConfig(
                principal=principal, authority=authority, budget=budget, grant=grant, approval_policy=approval_policy,
                approver=approver, declared=declared, max_workers=max_workers, tenant=tenant,
                approval_hook=approval_hook, cluster=cluster, queue=queue, control_plane=control_plane,
                credential=credential)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
                                 for e in exc.errors())
            raise ConfigurationError(f"AISchedTaskRunner: {problems}") from None
        super().__init__(max_workers=max_workers)
        self._session: RunnerSession | None = None
        self._session_error: BaseException | None = None
        self._entered = False
        self._lock = threading.Lock()
        self._loop: LoopThread | None = None
        self._signals = StopSignals(self._stop_signal)

    @property
    def config(self) -> RunnerConfig:
        return self._config

    def duplicate(self) -> AISchedTaskRunner:
        return type(self)(**{name: getattr(self._config, name) for name in RunnerConfig.model_fields})

    @property
    def session(self) -> RunnerSession:
        """The flow run's session, opened by its first AI task call.

        Lazily, so that a configuration problem (a missing block, no credential, a control plane
        that does not answer) fails the AI task that met it, and so the flow run ends Failed with
        that one message, instead of failing the runner's start, which leaves the run Running.
        """
        with self._lock:
            if not self._entered:
                raise NoAdmissionContext("AISchedTaskRunner is not started: AI tasks run inside the flow that uses it")
            if self._session_error is not None:
                raise self._session_error
            if self._session is None:
                try:
                    self._session = RunnerSession(self._config, self._calls_loop())
                except BaseException as exc:
                    self._session_error = exc
                    raise
            return self._session

    def _calls_loop(self) -> LoopThread:
        """The one event loop of this flow run's AI task runs (made at the first; called under `_lock`)."""
        if self._loop is None:
            self._loop = LoopThread()
        return self._loop

    def submit(self, task: Any, parameters: dict[str, Any], wait_for: Any = None, dependencies: Any = None) -> Any:
        """A plain task runs in a thread, as under ThreadPoolTaskRunner; an AI task waits as a coroutine on the
        runner's loop, so a `.map()` over 10,000 shards holds no thread per shard (Prefect's async task engine
        keeps its states, retries and results)."""
        from aisched_prefect.flow.task import async_twin, request_of

        if request_of(task) is None:
            return super().submit(task, parameters, wait_for, dependencies)
        if not self._started:
            raise RuntimeError("Task runner is not started")
        from contextvars import copy_context

        from prefect._internal.uuid7 import uuid7
        from prefect.futures import PrefectConcurrentFuture

        with self._lock:
            loop = self._calls_loop()
        task_run_id = uuid7()
        coro = _run_ai_task(loop, async_twin(task), task_run_id, parameters, wait_for, dependencies)
        context = copy_context()
        mapping = MAPPING.get()
        if mapping is not None:  # a shard of the `.map()` being submitted: the plane admits the map as one array
            context.run(MAP_SHARD.set, (mapping[0], next(mapping[2]), mapping[1]))
        return PrefectConcurrentFuture(task_run_id=task_run_id, wrapped_future=loop.start(coro, context))

    def map(self, task: Any, parameters: dict[str, Any], wait_for: Any = None) -> Any:
        """Prefect's `map` (a submit per shard); an AI task's shards are told they are one array (a random id, each
        shard's index, the map's size), so the control plane decides, and asks a person, once for all of them."""
        from aisched_prefect.flow.task import request_of

        if request_of(task) is None:
            return super().map(task, parameters, wait_for)
        import itertools
        import uuid

        token = MAPPING.set((uuid.uuid4().hex, map_size(parameters), itertools.count()))
        try:
            return super().map(task, parameters, wait_for)
        finally:
            MAPPING.reset(token)

    def __enter__(self) -> AISchedTaskRunner:
        super().__enter__()
        self._entered = True
        self._signals.__enter__()
        return self

    def _stop_signal(self, why: str) -> None:
        """A signal handler's part (no locks): the session's waits for people end and withdraw at once."""
        session = self._session
        if session is not None:
            session.interrupt(why)

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        self._signals.__exit__()
        try:
            super().__exit__(exc_type, exc_value, traceback)  # waits for running task engines
        finally:
            with self._lock:
                session, self._session, self._entered, self._session_error = self._session, None, False, None
                loop, self._loop = self._loop, None
            try:
                if session is not None:
                    session.close(stopped_by(exc_type))
            finally:
                if loop is not None:
                    loop.close()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AISchedTaskRunner) and other._config == self._config

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._signals = StopSignals(self._stop_signal)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_session"] = None
        state["_executor"] = None
        state["_session_error"] = None
        state["_entered"] = False
        state["_loop"] = None
        state.pop("_lock", None)
        state.pop("_signals", None)
        return state


def map_size(parameters: dict[str, Any]) -> int | None:
    """How many shards a `.map()` over these parameters makes, where a mapped parameter says so without being
    resolved (a list, a range); None where none does (futures: Prefect resolves them in its `map`)."""
    from prefect.utilities.annotations import allow_failure, quote, unmapped

    for value in parameters.values():
        if isinstance(value, (allow_failure, quote)):
            value = value.unwrap()
        if isinstance(value, unmapped) or isinstance(value, (str, bytes, dict)):
            continue
        try:
            return len(value) or None
        except TypeError:
            continue
    return None


def stopped_by(exc_type: Any) -> str:
    """Why the flow stopped waiting, in the words its withdrawn approval requests record."""
    name = getattr(exc_type, "__name__", "")
    if exc_type is None:
        return "the flow run ended while it waited"
    if name == "KeyboardInterrupt":
        return WHY[signal.SIGINT]
    if name == "TerminationSignal":
        return WHY[signal.SIGTERM]
    return f"the flow run stopped ({name})"


async def _run_ai_task(loop: LoopThread, task: Any, task_run_id: Any, parameters: dict[str, Any], wait_for: Any,
                       dependencies: Any) -> Any:
    """Prefect's async task engine for one AI task run, once the futures it depends on are done (awaited here:
    the engine would block the loop on them, and they may be runs on this same loop). Every run on the loop
    shares one Prefect client (the engine would otherwise make one, with its TLS context, per run)."""
    from prefect.context import AsyncClientContext
    from prefect.futures import PrefectFuture

    AsyncClientContext.__var__.set(await loop.prefect_client())
    from prefect.task_engine import run_task_async
    from prefect.utilities.collections import visit_collection

    futures: list[PrefectFuture[Any]] = []

    def collect(expr: Any) -> Any:
        if isinstance(expr, PrefectFuture):
            futures.append(expr)
        return expr

    visit_collection(parameters, visit_fn=collect, return_data=False)
    visit_collection(wait_for, visit_fn=collect, return_data=False)
    if futures:
        await _all_done(futures)
    from aisched_prefect.flow.stream import ENGINE_SLOT

    slot = loop.engine_slot()
    ENGINE_SLOT.set(slot)
    await slot.acquire()
    try:
        return await run_task_async(task=task, task_run_id=task_run_id, parameters=parameters, wait_for=wait_for,
                                    return_type="state", dependencies=dependencies)
    finally:
        slot.release()


async def _all_done(futures: list[Any]) -> None:
    import asyncio

    loop = asyncio.get_running_loop()
    for f in futures:
        done = loop.create_future()
        f.add_done_callback(lambda _f, d=done: loop.call_soon_threadsafe(lambda: d.done() or d.set_result(None)))
        await done
