"""aisched-prefect: admission, placement, budgets, approvals and evidence for AI tasks in Prefect."""

from aisched_prefect.approvals import ApprovalDecision, ApprovalInput
from aisched_prefect.body import task_logger
from aisched_prefect.client import ControlPlaneClient, ControlPlaneError, ControlPlaneUnavailable
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
    TooManyOpenApprovals,
)
from aisched_prefect.evidence import ChainReport, EvidenceRecord, verify_chain
from aisched_prefect.ledger import Ledger
from aisched_prefect.report import evidence_rows
from aisched_prefect.request import AIRequest
from aisched_prefect.runner import AISchedTaskRunner
from aisched_prefect.task import ai_task, request_of
from aisched_prefect.usage import ReportedUsage, report_usage
from aisched_prefect.wire import ApprovalView
from dask_gpu import checkpoint, current_devices, current_worker, run_subprocess
from dask_gpu.tickets import TicketRejected

__all__ = [
    "AIRequest",
    "AISchedError",
    "AISchedTaskRunner",
    "AdmissionDenied",
    "ApprovalDecision",
    "ApprovalInput",
    "ApprovalView",
    "ChainReport",
    "ConfigurationError",
    "ControlPlaneClient",
    "ControlPlaneError",
    "ControlPlaneUnavailable",
    "EvidenceRecord",
    "InvalidAIRequest",
    "InvalidConfig",
    "InvalidUsage",
    "Ledger",
    "LedgerUnavailable",
    "NoAdmissionContext",
    "ReportedUsage",
    "RequestTooLarge",
    "TicketRejected",
    "TooManyOpenApprovals",
    "ai_task",
    "checkpoint",
    "current_devices",
    "current_worker",
    "evidence_rows",
    "report_usage",
    "request_of",
    "run_subprocess",
    "task_logger",
    "verify_chain",
]
