"""Asking Slurm about jobs with its own clients: which jobs are still queued or running, and how one ended.

Used by the scaler (dask_gpu.slurm.scaler) to notice worker jobs that ended outside it (`scancel`, a time limit, a
node gone), and by the control plane to record why a worker in a Slurm job died under a run (the job's state and
reason as `scontrol show job` gives them: CANCELLED, TIMEOUT with Reason=TimeLimit, NODE_FAIL, ...). Every call has a
short timeout and answers "unknown" rather than raise: Slurm's word is evidence, never a condition for recording.
"""

from __future__ import annotations

import getpass
import re
import shutil
import subprocess
import time

from pydantic import BaseModel, ConfigDict

LIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING")
TIMEOUT_SECONDS = 5.0
SETTLE_SECONDS = 15.0  # how long a job still COMPLETING is asked again for its final state


class JobEnd(BaseModel):
    """A Slurm job's state and reason, as Slurm tells them (state "unknown" where it could not be asked)."""

    model_config = ConfigDict(frozen=True)

    job: str
    state: str = "unknown"
    reason: str = ""
    exit_code: str = ""

    def describe(self) -> str:
        why = f", reason {self.reason}" if self.reason and self.reason != "None" else ""
        return f"Slurm job {self.job}: {self.state}{why}"


def _run(argv: list[str]) -> str | None:
    exe = shutil.which(argv[0])
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=TIMEOUT_SECONDS)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def job_end(job: str, settle_seconds: float = SETTLE_SECONDS) -> JobEnd:
    """How job `job` stands or ended: `scontrol show job` (it keeps ended jobs for MinJobAge), else `sacct`.

    A job whose processes are still being ended reads COMPLETING, which hides why (CANCELLED, TIMEOUT, ...): it is
    asked again for up to `settle_seconds`, then taken as it reads."""
    deadline = time.monotonic() + settle_seconds
    while True:
        out = _run(["scontrol", "show", "job", "-o", str(job)])
        if not out:
            break
        fields = dict(re.findall(r"(\w+)=(\S*)", out))
        end = JobEnd(job=str(job), state=fields.get("JobState", "unknown"), reason=fields.get("Reason", ""),
                     exit_code=fields.get("ExitCode", ""))
        if end.state != "COMPLETING" or time.monotonic() > deadline:
            return end
        time.sleep(0.25)
    out = _run(["sacct", "-n", "-X", "-P", "-j", str(job), "-o", "State,Reason,ExitCode"])
    if out and out.strip():
        state, _, rest = out.strip().splitlines()[0].partition("|")
        reason, _, code = rest.partition("|")
        return JobEnd(job=str(job), state=state.split()[0], reason=reason, exit_code=code)
    return JobEnd(job=str(job))


def queue_states(jobs: list[str]) -> dict[str, tuple[str, str]] | None:
    """Each of `jobs` still queued or running: its state and Slurm's reason (why a pending job waits: Resources,
    Priority, PartitionDown, ...); None where squeue could not be asked."""
    if not jobs:
        return {}
    out = _run(["squeue", "-h", "-u", getpass.getuser(), "-o", "%i|%T|%r"])  # this user's: a forgotten id is no error
    if out is None:
        return None
    found: dict[str, tuple[str, str]] = {}
    for line in out.splitlines():
        job, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        if job in jobs and state.strip() in LIVE:
            found[job] = (state.strip(), reason.strip())
    return found


def live_jobs(jobs: list[str]) -> dict[str, str] | None:
    """Each of `jobs` still queued or running, with its state; None where squeue could not be asked."""
    states = queue_states(jobs)
    return None if states is None else {j: s for j, (s, _) in states.items()}


def slurm_end(job: str | None) -> JobEnd | None:
    """`job_end` for a worker that ran in Slurm job `job`; None for a worker outside Slurm."""
    return job_end(job) if job else None


__all__ = ["JobEnd", "job_end", "live_jobs", "queue_states", "slurm_end"]
