"""What runs on the Dask worker: check the signed admission ticket, then call the task on its devices."""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from distributed import get_worker

from aisched_prefect.request import AIRequest
from aisched_prefect.tickets import AdmissionTicket, check_ticket
from aisched_prefect.usage import ReportedUsage, close_tally, open_tally, summed
from dask_gpu import DeviceRun, hold_devices


class WorkerOutcome(BaseModel):
    """The result or error of one call, and where it ran, whatever happened."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    ok: bool
    value: Any = None
    error: BaseException | None = None
    error_text: str = ""
    run: DeviceRun
    logs: list[tuple[int, str]] = []  # (level, message) the task logged, replayed into its Prefect task run
    usage: ReportedUsage | None = None  # what the task reported with report_usage()


TASK_LOGGER = "aisched.task"


def task_logger() -> logging.Logger:
    """Logger for code inside an AI task body: its records reach the Prefect UI under the task run.

    `prefect.get_run_logger()` needs the task-run context, which stays in the
    flow process; the body runs on a Dask worker. Records at INFO and above
    that the task's thread emits (through this logger or any logger that
    reaches the root) are sent back with the result and logged there.
    """
    logger = logging.getLogger(TASK_LOGGER)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    return logger


class _ThreadLogCapture(logging.Handler):
    """Collects the records of one thread (the task's), leaving Dask's own logs alone."""

    def __init__(self, thread_id: int) -> None:
        super().__init__(logging.INFO)
        self.thread_id = thread_id
        self.records: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread_id and not record.name.startswith(("distributed", "tornado", "asyncio")):
            self.records.append((record.levelno, record.getMessage()))


def run_admitted(ticket: AdmissionTicket | None, request: AIRequest, fn: Callable[..., Any],
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> WorkerOutcome:
    """Dask task body of every AI task run. No ticket, no run."""
    worker = get_worker()
    check_ticket(ticket, request.digest, worker)
    capture = _ThreadLogCapture(threading.get_ident())
    root = logging.getLogger()
    root.addHandler(capture)
    reports, token = open_tally()
    try:
        with hold_devices(request.gpu_request()) as lease:
            try:
                value, ok, error, text = fn(*args, **kwargs), True, None, ""
            except Exception as exc:  # returned, not raised: settlement needs `lease.run()` too
                value, ok, error, text = None, False, exc, traceback.format_exc()
    finally:
        close_tally(token)
        root.removeHandler(capture)
    return WorkerOutcome(ok=ok, value=value, error=error, error_text=text, run=lease.run(), logs=capture.records,
                         usage=summed(reports))
