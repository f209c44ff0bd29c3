"""Expected outcomes read as such: a denial or a suspension for approval is one WARNING line, not a crash; a set-up
error (a refused credential, a plane that does not answer, a task outside its runner) is one ERROR line with its fix.

Prefect logs every exception that ends a task or flow run at ERROR with its
traceback. A run denied at admission (with its reason and fix in the message)
or suspended to wait for a person is not a crash: a filter on Prefect's run
loggers turns those records into one WARNING line each. The run's state is
unchanged (a denied task run is still Failed, so nothing downstream mistakes
it for a result).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from aisched_prefect.errors import AdmissionDenied, ApprovalWithdrawn, SetupError
from aisched_prefect.flow.approval_wait import ApprovalSuspended

EXPECTED = (AdmissionDenied, ApprovalSuspended, ApprovalWithdrawn)
ONE_LINE = (*EXPECTED, SetupError)  # what ends a script in one line (its message names the fix)
_NAMES = tuple(cls.__name__ for cls in EXPECTED)
_SETUP_NAMES = ("SetupError", "NoAdmissionContext", "ConfigurationError", "CredentialRefused",
                "ControlPlaneUnavailable", "ControlPlaneError", "UnshippableCode")
PREFECT_SERVER_TIMEOUT = "Timed out while attempting to connect to ephemeral Prefect API server"
TIMEOUT_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
RUN_LOGGERS = ("prefect.task_runs", "prefect.flow_runs")


class ExpectedOutcome(logging.Filter):
    """Lower records about a denial or a suspension to one WARNING line, without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, EXPECTED) or (record.levelno >= logging.ERROR and any(
                f"{name}(" in str(record.msg) or f"{name}:" in str(record.msg) for name in _NAMES)):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info, record.exc_text, record.stack_info = None, None, None
        elif _traceback_wanted():
            return True
        elif isinstance(exc, SetupError) or any(f"{name}(" in str(record.msg) or f"{name}:" in str(record.msg)
                                                 for name in _SETUP_NAMES):
            record.exc_info, record.exc_text, record.stack_info = None, None, None  # the message says it all
        return True


def _traceback_wanted() -> bool:
    return os.environ.get("AISCHED_TRACEBACK") == "1"


def setup_line(exc: BaseException) -> str | None:
    """The one line a script ends on for a set-up failure it could not have run past, or None (not one of those)."""
    if isinstance(exc, ONE_LINE):
        return f"{type(exc).__name__}: {exc}"
    if isinstance(exc, RuntimeError) and str(exc).startswith(PREFECT_SERVER_TIMEOUT):
        waited = os.environ.get(TIMEOUT_SETTING, "20")
        return (f"Prefect's temporary server did not answer within {waited}s (this host is busy). Fix: run it again, "
                f"or give it longer ({TIMEOUT_SETTING}=600), or start one server (`prefect server start`) and "
                "set PREFECT_API_URL=http://127.0.0.1:4200/api")
    return None


_filter = ExpectedOutcome()


def one_line(exc_type: type[BaseException], exc: BaseException, tb: Any, previous: Any = None) -> None:
    """`sys.excepthook` for a script whose flow ended on an expected outcome (a denial: its reason and fix are the
    message): that message, once, instead of a 70-line traceback through Prefect's engine. AISCHED_TRACEBACK=1, or
    any other exception, prints the whole traceback as Python does."""
    line = None if _traceback_wanted() else setup_line(exc)
    if line is not None:
        sys.stderr.write(f"{line}\n(the whole traceback: AISCHED_TRACEBACK=1)\n")
        return
    (previous or sys.__excepthook__)(exc_type, exc, tb)


def quiet_expected_outcomes() -> None:
    """Install the filter on Prefect's run loggers, and the one-line hook for a denial that ends the script (once
    per process; a hook someone else installed is kept for everything else)."""
    if getattr(sys.excepthook, "__name__", "") != "_aisched_one_line":
        previous = sys.excepthook

        def _aisched_one_line(exc_type: Any, exc: Any, tb: Any) -> None:
            one_line(exc_type, exc, tb, previous)

        sys.excepthook = _aisched_one_line
    for name in RUN_LOGGERS:
        logger = logging.getLogger(name)
        if _filter not in logger.filters:
            logger.addFilter(_filter)
