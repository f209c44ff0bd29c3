"""aisched-prefect: admission, placement, budgets, approvals and evidence for AI tasks in Prefect."""

from aisched_prefect.approvals import (
    ApprovalDecision,
    ApprovalInput,
    ApprovalRequest,
    Approver,
    PolicyApprover,
    PrefectPauseApprover,
)
from aisched_prefect.errors import (
    AdmissionDenied,
    AISchedError,
    ConfigurationError,
    InvalidAIRequest,
    InvalidUsage,
    NoAdmissionContext,
    TicketRejected,
)
from aisched_prefect.evidence import ChainReport, EvidenceRecord, verify_chain
from aisched_prefect.ledger import Ledger
from aisched_prefect.report import evidence_rows
from aisched_prefect.request import AIRequest
from aisched_prefect.runner import AISchedTaskRunner
from aisched_prefect.task import ai_task, request_of
from aisched_prefect.usage import ReportedUsage, report_usage
from aisched_prefect.worker import task_logger
from dask_gpu import current_devices, run_subprocess

__all__ = [
    "AIRequest",
    "AISchedError",
    "AISchedTaskRunner",
    "AdmissionDenied",
    "ApprovalDecision",
    "ApprovalInput",
    "ApprovalRequest",
    "Approver",
    "ChainReport",
    "ConfigurationError",
    "EvidenceRecord",
    "InvalidAIRequest",
    "InvalidUsage",
    "Ledger",
    "NoAdmissionContext",
    "PolicyApprover",
    "PrefectPauseApprover",
    "ReportedUsage",
    "TicketRejected",
    "ai_task",
    "current_devices",
    "evidence_rows",
    "report_usage",
    "request_of",
    "run_subprocess",
    "task_logger",
    "verify_chain",
]
