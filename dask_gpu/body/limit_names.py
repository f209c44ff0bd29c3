"""A body stopped at one of its limits is told by the limit's name (PIDs, memory, /tmp), not by the raw error the
kernel gave its code (`BlockingIOError: [Errno 11] Resource temporarily unavailable` from a fork bomb).

Runs inside the body (no key held): it reads only the body's own cgroup files, best effort.
"""

from __future__ import annotations

import errno
import re
from pathlib import Path
from typing import Any

SETTING = {"pids": "dask-gpu.isolation.body-pids (dask-gpu-worker --body-pids)",
           "memory": "dask-gpu.isolation.body-memory-gb (dask-gpu-worker --body-memory-gb)",
           "tmp": "the body's private /tmp, which lives in its memory (dask-gpu.isolation.body-memory-gb)"}


def _cgroup_file(name: str) -> str | None:
    """This process's cgroup v2 file `name` (e.g. pids.max), or None where there is none or it cannot be read."""
    try:
        line = next((ln for ln in Path("/proc/self/cgroup").read_text().splitlines() if ln.startswith("0::")), None)
        if line is None:
            return None
        return (Path("/sys/fs/cgroup") / line[3:].lstrip("/") / name).read_text().strip()
    except (OSError, StopIteration):
        return None


def limit_reached(exc: BaseException) -> str | None:
    """The limit `exc` means the body reached, in words with the setting that raises it; None: not a limit."""
    if isinstance(exc, OSError) and exc.errno == errno.EAGAIN and isinstance(exc, BlockingIOError) or (
            isinstance(exc, RuntimeError) and "can't start new thread" in str(exc)):
        most = _cgroup_file("pids.max")
        bound = f" ({most} processes and threads)" if most and most != "max" else ""
        return (f"the body reached its process limit, PIDs{bound}: it could not start another process or thread "
                f"({type(exc).__name__}: {exc}). Fix: start fewer processes or threads in the task (a pool's size), "
                f"or the operator raises {SETTING['pids']}")
    if isinstance(exc, MemoryError):
        most = _cgroup_file("memory.max")
        bound = f" ({int(most) / 2**30:.1f} GiB)" if most and most.isdigit() else ""
        return (f"the body reached its memory limit{bound} (MemoryError). Fix: use less memory in the task (smaller "
                f"batches), or the operator raises {SETTING['memory']}")
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT) and re.match(
            r"/tmp(/|$)", str(getattr(exc, "filename", "") or "")):
        return (f"the body's /tmp is full ({type(exc).__name__}: {exc}): it lives in the body's memory. Fix: write "
                f"large files to a data path the worker gives the tenant, or the operator raises {SETTING['tmp']}")
    return None


class LimitReached(Exception):
    """A body's run stopped at one of its limits (PIDs, memory, /tmp): what its caller raises, the message naming
    the limit and the setting; the kernel's own error is in the run's traceback text."""


def name_the_limit(out: dict[str, Any], exc: BaseException) -> BaseException:
    """The error a failed run reports: `LimitReached` naming the limit it reached (its message and type written into
    `out`), else `exc` as it was."""
    named = limit_reached(exc)
    if named is None:
        return exc
    out["error_message"] = named
    out["error_type"] = f"{LimitReached.__module__}.{LimitReached.__qualname__}"
    return LimitReached(named)
