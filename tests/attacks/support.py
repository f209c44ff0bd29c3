"""What the attack tests share: fresh tenants with grant ids of their own, flows run as a flow would, waits with deadlines.

Every authority here gets root ids no other test uses: a revocation names a grant by id,
and ids are not scoped to an authority (see test_delegation's cross-authority holes),
so a shared id would let one test's revocation reach another's tenant.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Callable

from prefect import flow
from prefect.context import FlowRunContext

from aisched_prefect import AdmissionDenied, ai_task
from blocks import AuthorityBlock, BudgetBlock, Grant

PRINCIPAL = "team-a/nightly"


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def root(principal: str = PRINCIPAL, **kw: Any) -> Grant:
    """A root grant with an id of its own (4 GPUs, 10 per run unless overridden)."""
    fields = {"id": uid("root"), "principal": principal, "max_gpus": 4, "max_cost_per_run": 10.0}
    return Grant(**{**fields, **kw})


def authority(*grants: Grant, **block: Any) -> AuthorityBlock:
    return AuthorityBlock(grants=list(grants) or [root()], **block)


def budget(limit: float = 100.0) -> BudgetBlock:
    return BudgetBlock(limit=limit, gpu_hour_prices={"H100": 4.0, "A10": 1.0}, token_prices_per_1k={"*": 0.01})


def tenant(plane: Any, *grants: Grant, principal: str = PRINCIPAL, policy: Any = None, **block: Any) -> Any:
    """A slice of `plane`: an authority of these grants (default: one fresh root for `principal`), a budget, a
    flow credential for `principal`."""
    return plane.tenant(authority(*(grants or (root(principal),)), **block), budget(), policy, principal=principal)


def runner_for(plane: Any, token: str, **kw: Any) -> Any:
    """The runner of a flow that holds `token`."""
    from aisched_prefect import AISchedTaskRunner

    return AISchedTaskRunner(control_plane=plane.url, credential=token, **kw)


def flow_credential(plane: Any, t: Any, principal: str) -> str:
    """Another flow credential bound to tenant `t`'s applied configuration."""
    return plane.issue(principal, authority=t.authority, budget=t.budget, tenant=principal.split("/")[0])


@ai_task(gpus=1, gpu_type="H100", kind="inference", est_seconds=5)
def infer(i: int = 0) -> int:
    return i


@ai_task(gpus=2, gpu_type="H100", kind="training", est_seconds=20)
def train() -> str:
    return "trained"


def outcome(task: Any, *args: Any) -> Any:
    """The call's result, or 'denied: <message>' when the control plane refused it."""
    try:
        return task(*args)
    except AdmissionDenied as exc:
        return f"denied: {exc}"


def run_flow(runner: Any, body: Callable[[], Any], name: str | None = None) -> tuple[Any, str]:
    """Run `body` in a flow with `runner`; its return value and the flow run's id."""

    @flow(name=name or uid("attack"), task_runner=runner)
    def f() -> tuple[Any, str]:
        return body(), str(FlowRunContext.get().flow_run.id)

    return f()


class FlowThread:
    """A flow run in a thread of this process (a flow process doing its own thing meanwhile)."""

    def __init__(self, runner: Any, body: Callable[[], Any], name: str | None = None) -> None:
        self.result: list[Any] = []
        self.error: list[BaseException] = []

        def go() -> None:
            try:
                self.result.append(run_flow(runner, body, name))
            except BaseException as exc:  # the test asserts on it
                self.error.append(exc)

        self.thread = threading.Thread(target=go, daemon=True)
        self.thread.start()

    def join(self, timeout: float = 120) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the flow run did not end"
        if self.error:
            raise self.error[0]
        return self.result[0]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll until `predicate()` is truthy; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def kinds(records: list[Any]) -> list[str]:
    return [r.kind for r in records]
