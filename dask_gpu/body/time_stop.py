"""A run asked to stop at its time limit, in its body: SIGTERM (what Slurm sends at `--time`) makes `checkpoint()`
raise StopRequested; the body is killed only later, if it has not stopped by then (`request_stop`).

The worker signals the body's process (`signal_body`) when the control plane asks for a soft stop
(`request_stop(..., soft=True)`); the body's process installs the handler once (`install`) and arms the event for
each run (`arm`), so `dask_gpu.checkpoint()` and `run_subprocess` see it as they see any stop.
"""

from __future__ import annotations

import contextvars
import os
import signal
import threading

STOPPED = "time limit"  # why a body that stopped after the signal was stopped
_asked = threading.Event()


def install() -> None:
    """In the body's process: SIGTERM asks the run to stop at its next checkpoint instead of killing the process."""
    try:
        signal.signal(signal.SIGTERM, lambda *_: _asked.set())
    except ValueError:  # not the main thread (a body run in-process by a test): no signal to take
        pass


def arm() -> contextvars.Token:
    """In the body's process, as a run begins: its stop event is the one SIGTERM sets (cleared: a new run)."""
    from dask_gpu.body.current import current_stop_var

    _asked.clear()
    return current_stop_var.set(_asked)


def signal_body(pid: int) -> bool:
    """On the worker: ask the body's process to stop at its next checkpoint. False if it is gone."""
    try:
        os.kill(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return False
    return True
