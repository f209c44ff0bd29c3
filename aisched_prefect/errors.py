"""Named errors of aisched-prefect. Every message names what was wrong and how to fix it."""

from __future__ import annotations


class AISchedError(Exception):
    """Base class for every error raised by aisched_prefect."""


def shown(value: object, longest: int = 60) -> str:
    """A value as an error message shows it: its repr, cut to `longest` characters (a 100,000-character name is
    named by its start and its length, not pasted whole)."""
    text = repr(value)
    if len(text) <= longest:
        return text
    size = f" ({len(value)} characters)" if isinstance(value, (str, bytes)) else ""
    return f"{text[:longest]}...{size}"


class InvalidAIRequest(AISchedError, ValueError):
    """An @ai_task declared a request that cannot be valid."""


class SetupError(AISchedError):
    """The flow could not start working with its control plane: a missing or refused credential, a plane that does
    not answer, a task run outside its runner. Its message names the fix; a script ends on it in one line (the
    traceback with AISCHED_TRACEBACK=1: aisched_prefect/logs.py)."""


class NoAdmissionContext(SetupError):
    """An AI task ran outside a flow whose task runner is AISchedTaskRunner."""


class AdmissionDenied(AISchedError):
    """A run was refused at admission; nothing ran and nothing stays reserved."""

    def __init__(self, stage: str, reason: str, fix: str) -> None:
        self.stage, self.reason, self.fix = stage, reason, fix
        super().__init__(f"denied at {stage}: {reason}. Fix: {fix}")


class ConfigurationError(SetupError, ValueError):
    """The runner was configured with something it cannot use."""


class UnshippableCode(SetupError, InvalidAIRequest):
    """An AI task's code cannot travel to a GPU worker (a `__main__` task carrying a lock, a client, an open file)."""


class CredentialRefused(SetupError):
    """The control plane refused the flow's credential (unknown, revoked, expired, or of another role)."""


class InvalidConfig(AISchedError, ValueError):
    """An operator's change (a configuration to apply, a credential to issue) that cannot be valid: refused before
    anything is recorded, naming the field and the fix."""

    status = 422

    def __init__(self, what: str, value: object, rule: str, fix: str) -> None:
        self.what, self.value, self.rule, self.fix = what, value, rule, fix
        super().__init__(f"{what}={shown(value)}: {rule}. Fix: {fix}")


class InvalidUsage(AISchedError, ValueError):
    """A task reported usage that cannot be right (negative tokens or cost)."""


class ResultMismatch(AISchedError):
    """A result's bytes are not the ones the control plane recorded: they were not unpickled."""


class ResultLost(AISchedError):
    """A completed run's result, kept on its worker, could not be fetched (used, expired, worker gone, unreachable)."""


class SchedulerLost(AISchedError):
    """The Dask scheduler went away while a run ran: its outcome is unknown, it was charged for the time it had."""


class ApprovalWithdrawn(AISchedError):
    """The flow stopped (Ctrl-C, SIGTERM, Prefect cancellation) while a run waited for a person: its request was
    withdrawn and its budget released; an answer given after that is told the run is gone."""


class InvalidLedgerInput(AISchedError, ValueError):
    """The ledger was given something it cannot book (a name too long, an unknown unit); nothing was changed."""

    def __init__(self, what: str, value: object, rule: str, fix: str) -> None:
        self.what, self.value, self.rule, self.fix = what, value, rule, fix
        self.reason = f"{what}={shown(value)}: {rule}"
        super().__init__(f"{self.reason}. Fix: {fix}")


class InvalidAmount(InvalidLedgerInput):
    """An amount given to the ledger is not a finite number in its range (NaN, inf, negative, huge)."""


class LedgerUnavailable(AISchedError):
    """The ledger's database could not be reached, or kept failing, after every retry; nothing was half-written.

    The control plane answers 503 with the cause: the request can be sent again once the database answers.
    """

    status = 503

    def __init__(self, cause: str, url: str = "", unknown: bool = False) -> None:
        self.cause = cause
        where = f" at {url}" if url else ""
        outcome = (" (the connection dropped while it committed: whether the write was kept could not be read back)"
                   if unknown else "")
        super().__init__(f"the ledger's database{where} failed: {cause}{outcome}. Fix: check that the database is up "
                         "and reachable from the control plane; then send the request again")


class RequestTooLarge(AISchedError):
    """A request body larger than the control plane takes (413); nothing of it was acted on."""

    status = 413

    def __init__(self, path: str, size: int | None, limit: int, setting: str) -> None:
        self.limit, self.setting = limit, setting
        got = f"is {size} bytes, more than" if size is not None else "passed"
        fix = (f"pass large data by reference (a path or URL the task reads) instead of as an argument, or an "
               f"operator raises {setting} on the control plane" if path in ("/v1/calls", "/v1/runs")
               else f"send less, or an operator raises {setting} on the control plane")
        super().__init__(f"the request to {path} {got} the {limit} bytes this control plane takes "
                         f"({setting}={limit}). Fix: {fix}")

    @classmethod
    def answered(cls, text: str) -> "RequestTooLarge":
        """The refusal as a client read it (a 413's text): its limit and setting taken from what it names."""
        import re

        err = cls.__new__(cls)
        AISchedError.__init__(err, text)
        named = re.search(r"(AISCHED_[A-Z_]+)=(\d+)", text)
        err.setting, err.limit = (named.group(1), int(named.group(2))) if named else ("", 0)
        return err


class TooManyOpenApprovals(AISchedError):
    """A credential already has as many requests waiting for a person as the control plane allows (429)."""

    status = 429

    def __init__(self, principal: str, open_: int, limit: int) -> None:
        super().__init__(f"{principal!r} already has {open_} requests waiting for a person, the most this control "
                         f"plane allows one credential (AISCHED_MAX_OPEN_APPROVALS={limit}); nothing was held for this "
                         "one. Fix: answer or let expire the open ones (aisched approvals list), or an operator "
                         "raises AISCHED_MAX_OPEN_APPROVALS")


class RunLost(AISchedError):
    """The control plane no longer knows an accepted AI task run, after the flow sent it again as many times as it
    may: the run fails with this instead of waiting for an outcome that will not come."""
