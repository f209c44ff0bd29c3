"""What an AI task's body may call while it runs in its own process on a GPU worker."""

from __future__ import annotations

import logging

TASK_LOGGER = "aisched.task"


def task_logger() -> logging.Logger:
    """Logger for code inside an AI task body: its records reach the Prefect UI under the task run.

    `prefect.get_run_logger()` needs the task-run context, which stays in the
    flow process; the body runs in its own process on a worker. Records at INFO
    and above that the body emits (through this logger or any logger that
    reaches the root) travel back with the result and are logged there.
    """
    logger = logging.getLogger(TASK_LOGGER)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    return logger
