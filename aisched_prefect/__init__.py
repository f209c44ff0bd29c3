"""aisched-prefect: admission, placement, budgets, approvals and evidence for AI tasks in Prefect.

The public names below are imported on first use (PEP 562), not with the package: `aisched --help` and the
commands that only talk to the control plane must not pay for Prefect, Dask and SQLAlchemy (seconds a command).
`from aisched_prefect import ai_task` works as before.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from dask_gpu.lazy import public_names

# The temporary Prefect server a flow starts when no PREFECT_API_URL is set sends a telemetry heartbeat whose first
# write races the new database's migration and prints a 130-line "database is locked" traceback into the flow's
# output. Off unless the user chose (the Makefile sets the same); a dedicated `prefect server start` is untouched.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

_WHERE = {
    "ApprovalDecision": "aisched_prefect.approvals",
    "ApprovalInput": "aisched_prefect.approvals",
    "task_logger": "aisched_prefect.body",
    "ControlPlaneClient": "aisched_prefect.flow.client",
    "ControlPlaneError": "aisched_prefect.flow.client",
    "ControlPlaneUnavailable": "aisched_prefect.flow.client",
    "AdmissionDenied": "aisched_prefect.errors",
    "AISchedError": "aisched_prefect.errors",
    "ConfigurationError": "aisched_prefect.errors",
    "InvalidAIRequest": "aisched_prefect.errors",
    "InvalidConfig": "aisched_prefect.errors",
    "InvalidUsage": "aisched_prefect.errors",
    "LedgerUnavailable": "aisched_prefect.errors",
    "NoAdmissionContext": "aisched_prefect.errors",
    "RequestTooLarge": "aisched_prefect.errors",
    "SchedulerLost": "aisched_prefect.errors",
    "TooManyOpenApprovals": "aisched_prefect.errors",
    "ChainReport": "aisched_prefect.evidence",
    "EvidenceRecord": "aisched_prefect.evidence",
    "verify_chain": "aisched_prefect.evidence",
    "Ledger": "aisched_prefect.ledger",
    "evidence_rows": "aisched_prefect.reports.runs",
    "AIRequest": "aisched_prefect.request",
    "AISchedTaskRunner": "aisched_prefect.flow.runner",
    "ai_task": "aisched_prefect.flow.task",
    "request_of": "aisched_prefect.flow.task",
    "ReportedUsage": "aisched_prefect.usage",
    "report_usage": "aisched_prefect.usage",
    "ApprovalView": "aisched_prefect.wire",
    "checkpoint": "dask_gpu",
    "current_devices": "dask_gpu",
    "current_worker": "dask_gpu",
    "current_worker_name": "dask_gpu",
    "run_subprocess": "dask_gpu",
    "TicketRejected": "dask_gpu.errors",
}

__all__ = sorted(_WHERE)
__getattr__, __dir__ = public_names(__name__, _WHERE, globals())


if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from aisched_prefect.approvals import ApprovalDecision, ApprovalInput
    from aisched_prefect.body import task_logger
    from aisched_prefect.flow.client import ControlPlaneClient, ControlPlaneError, ControlPlaneUnavailable
    from aisched_prefect.errors import (
        AdmissionDenied,
        AISchedError,
        ConfigurationError,
        InvalidAIRequest,
        InvalidConfig,
        InvalidUsage,
        LedgerUnavailable,
        NoAdmissionContext,
        RequestTooLarge,
        SchedulerLost,
        TooManyOpenApprovals,
    )
    from aisched_prefect.evidence import ChainReport, EvidenceRecord, verify_chain
    from aisched_prefect.ledger import Ledger
    from aisched_prefect.reports.runs import evidence_rows
    from aisched_prefect.request import AIRequest
    from aisched_prefect.flow.runner import AISchedTaskRunner
    from aisched_prefect.flow.task import ai_task, request_of
    from aisched_prefect.usage import ReportedUsage, report_usage
    from aisched_prefect.wire import ApprovalView
    from dask_gpu import checkpoint, current_devices, current_worker, current_worker_name, run_subprocess
    from dask_gpu.errors import TicketRejected
