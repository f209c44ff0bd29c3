"""What runs on the Dask worker: check the admission ticket, then call the task on its devices."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from aisched_prefect.errors import TicketRejected
from aisched_prefect.request import AIRequest
from dask_gpu import DeviceRun, hold_devices


class AdmissionTicket(BaseModel):
    """Proof that a run passed admission, bound to its task run and request."""

    model_config = ConfigDict(frozen=True)

    admission_seq: int
    task_run_id: str
    request_digest: str
    grant_id: str
    expires_at: float


class WorkerOutcome(BaseModel):
    """The result or error of one call, and where it ran, whatever happened."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    ok: bool
    value: Any = None
    error: BaseException | None = None
    error_text: str = ""
    run: DeviceRun


def check_ticket(ticket: AdmissionTicket | None, request: AIRequest) -> None:
    if ticket is None:
        raise TicketRejected("no admission ticket: AI tasks run only after admission by AISchedTaskRunner")
    if ticket.request_digest != request.digest:
        raise TicketRejected(f"ticket for task run {ticket.task_run_id} was issued for another request")
    if time.time() > ticket.expires_at:
        raise TicketRejected(f"ticket for task run {ticket.task_run_id} expired; the run must be admitted again")


def run_admitted(ticket: AdmissionTicket | None, request: AIRequest, fn: Callable[..., Any],
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> WorkerOutcome:
    """Dask task body of every AI task run. No ticket, no run."""
    check_ticket(ticket, request)
    with hold_devices(request.gpu_request()) as lease:
        try:
            value, ok, error, text = fn(*args, **kwargs), True, None, ""
        except Exception as exc:  # returned, not raised: settlement needs `lease.run()` too
            value, ok, error, text = None, False, exc, traceback.format_exc()
    return WorkerOutcome(ok=ok, value=value, error=error, error_text=text, run=lease.run())
