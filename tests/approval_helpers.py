"""Flows that wait for a person, and the ways people answer them, against the shared control plane.

A `Gated` flow runs in a thread of the test process (as `python my_flow.py`
would) with a tenant's credential; the test then answers as people do: on the
control plane's approval page (an HTTP form POST with an approver credential),
through its API (an approver's Bearer token, or an Ed25519 signature), or by
typing into the Prefect pause form (`resume_flow_run`), which proves nothing.
"""

from __future__ import annotations

import threading
import time
import uuid
from urllib.parse import urlencode
from typing import Any, Callable

from prefect import flow
from prefect.context import FlowRunContext

from aisched_prefect import AdmissionDenied
from aisched_prefect.approvals import sign_approval
from aisched_prefect.wire import ApprovalView


def outcome(call: Callable[[], Any]) -> Any:
    """The call's result, or "denied: <message>" when admission refused it."""
    try:
        return call()
    except AdmissionDenied as exc:
        return f"denied: {exc}"


class Gated:
    """A flow run (in a thread) whose body calls AI tasks that need a person's approval."""

    def __init__(self, tenant: Any, body: Callable[[], Any], *, name: str | None = None, version: str | None = None,
                 **runner: Any) -> None:
        self.tenant, self.plane = tenant, tenant.plane
        self.name = name or f"gated-{uuid.uuid4().hex[:8]}"
        self.result: list[Any] = []
        self.error: list[BaseException] = []
        self._ids: list[str] = []
        self.asked: list[str] = []  # approval ids already handed to the test, in order

        @flow(name=self.name, version=version, task_runner=tenant.runner(**runner))
        def gated() -> Any:
            self._ids.append(str(FlowRunContext.get().flow_run.id))
            return body()

        def run() -> None:
            try:
                self.result.append(gated())
            except BaseException as exc:  # the test asserts on it
                self.error.append(exc)

        self.thread = threading.Thread(target=run, name=self.name, daemon=True)
        self.thread.start()

    @property
    def flow_run_id(self) -> str:
        deadline = time.time() + 60
        while not self._ids:
            assert time.time() < deadline and self.thread.is_alive(), "the flow run never started"
            time.sleep(0.05)
        return self._ids[0]

    def waiting(self, n: int, timeout: float = 60) -> list[ApprovalView]:
        """Wait until `n` requests of this flow run wait at the control plane (a .map()); them, oldest first."""
        deadline = time.time() + timeout
        flow_run_id = self.flow_run_id
        while time.time() < deadline:
            views = [ApprovalView.model_validate(v) for v in self.plane.ok("GET", "/v1/approvals")
                     if v["flow_run_id"] == flow_run_id and v["id"] not in self.asked]
            if len(views) >= n:
                self.asked.extend(v.id for v in views)
                return views
            assert self.thread.is_alive(), f"the flow run ended: {self.result or self.error}"
            time.sleep(0.1)
        raise AssertionError(f"{n} requests of this flow run never waited at once")

    def pauses(self) -> int:
        """How many times the flow run was Paused in Prefect."""
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return sum(1 for s in client.read_flow_run_states(self.flow_run_id) if s.is_paused())

    def approval(self, timeout: float = 60) -> ApprovalView:
        """The next request of this flow run waiting for a person, as an approver lists it at the control plane."""
        deadline = time.time() + timeout
        flow_run_id = self.flow_run_id
        while time.time() < deadline:
            for v in self.plane.ok("GET", "/v1/approvals"):
                if v["flow_run_id"] == flow_run_id and v["id"] not in self.asked:
                    self.asked.append(v["id"])
                    return ApprovalView.model_validate(v)
            assert self.thread.is_alive(), f"the flow run ended without asking: {self.result or self.error}"
            time.sleep(0.1)
        raise AssertionError("no approval request of this flow run reached the control plane")

    def prefect_state(self) -> Any:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return client.read_flow_run(self.flow_run_id).state

    def paused(self, timeout: float = 60, other_than: str | None = None) -> Any:
        """Wait until the flow run is Paused in Prefect (under a pause other than `other_than`); its state."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.prefect_state()
            if state is not None and state.is_paused() and str(state.state_details.pause_key) != str(other_than):
                return state
            assert self.thread.is_alive(), "the flow run ended instead of pausing"
            time.sleep(0.2)
        raise AssertionError("the flow run never paused in Prefect")

    def type_into_prefect_form(self, answer: dict[str, Any], timeout: float = 60) -> Any:
        """Resume the pause with `answer`, as anyone with the Prefect UI (or the flow itself) can; its pause state."""
        from prefect.flow_runs import resume_flow_run

        deadline = time.time() + timeout
        while True:
            state = self.paused(timeout)
            try:  # the form's schema is saved just after the Paused state
                resume_flow_run(self.flow_run_id, run_input=answer)
                return state
            except Exception:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)

    def outcome(self, timeout: float = 120) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the flow run did not finish"
        if self.error:
            raise self.error[0]
        return self.result[0]

    def records(self) -> list[Any]:
        return self.plane.records(self.flow_run_id)

    def kinds(self) -> list[str]:
        return [r.kind for r in self.records()]


def page_answer(plane: Any, approval_id: str, token: str, approve: bool = True, reason: str = "",
                items: tuple[str, ...] = ()) -> str:
    """Answer on the control plane's approval page, as a browser posts its form (`items`: the other runs ticked);
    the page shown back."""
    form = [("token", token), ("reason", reason), ("decision", "approve" if approve else "reject"),
            *(("item", i) for i in items)]
    resp = plane.http.post(f"/approve/{approval_id}", content=urlencode(form),
                           headers={"content-type": "application/x-www-form-urlencoded"})
    assert resp.status_code == 200, resp.text
    return resp.text


def api_answer(plane: Any, approval_id: str, token: str | None, approve: bool = True, reason: str = "",
               **body: Any) -> Any:
    """Answer through the API with a Bearer token (None: no credential, e.g. a signed answer); the response."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return plane.http.post(f"/v1/approvals/{approval_id}/answer", headers=headers,
                           json={"approve": approve, "reason": reason, **body})


def signed(key: Any, view: ApprovalView, approver: str, approve: bool = True, reason: str = "") -> dict[str, Any]:
    """The body `aisched approve --key` sends: the answer and its signature over the request's digest."""
    at = time.time()
    return {"approve": approve, "approver": approver, "reason": reason, "signed_at": at,
            "signature": sign_approval(key, view.digest, approve, approver, reason, at)}


def decision(records: list[Any]) -> dict[str, Any]:
    """The payload of the last decision on an approval."""
    return [r for r in records if r.kind == "approval"][-1].payload


def accounts_of(plane: Any, t: Any) -> list[dict[str, Any]]:
    return [a for a in plane.ledger().accounts() if a["budget"].split("/")[0].split("#")[0] == t.budget]


class RawCall:
    """One AI task call sent by hand, as a flow process could send it (what an attacker can do, too)."""

    def __init__(self, tenant: Any, task: Any, *args: Any, flow_run_id: str | None = None) -> None:
        import cloudpickle

        from aisched_prefect.flow.client import ControlPlaneClient
        from aisched_prefect.flow.task import request_of
        from aisched_prefect.wire import CallMeta
        from dask_gpu.body.code import code_digest

        body = task.fn.__wrapped__  # what the runner sends: the function @ai_task wraps
        fn = cloudpickle.dumps(body)
        self.blob = fn + cloudpickle.dumps((args, {}))
        self.flow_run_id = flow_run_id or str(uuid.uuid4())
        self.meta = CallMeta(task_name=task.name, task_run_id=str(uuid.uuid4()), flow_run_id=self.flow_run_id,
                             run_key=f"{self.flow_run_id}/{task.task_key}", request=request_of(task).model_dump(mode="json"),
                             code_digest=code_digest(body), modules=[body.__module__], args_offset=len(fn))
        self.client = ControlPlaneClient([tenant.plane.url], tenant.token)

    def send(self, admission: str | None = None, rerun: bool = False) -> tuple[Any, Any]:
        """Send the call (continuing `admission`; `rerun`: under a new task run id, as a re-run does); reply, result."""
        import cloudpickle

        update: dict[str, Any] = {"admission": admission}
        if rerun:
            update["task_run_id"] = str(uuid.uuid4())
        self.meta = self.meta.model_copy(update=update)
        reply, out = self.client.call(self.meta, self.blob)
        return reply, (cloudpickle.loads(out) if reply.status == "completed" else out)

    def close(self) -> None:
        self.client.close()
