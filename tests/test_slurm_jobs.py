"""Reading how a Slurm job ended, with stand-in `scontrol` and `squeue` commands on PATH (no Slurm needed)."""

from __future__ import annotations

import os
import stat

from dask_gpu.slurm.jobs import JobEnd, job_end, live_jobs, queue_states, slurm_end


def fake(bin_dir, name: str, script: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_a_job_still_completing_is_asked_again_until_it_says_why(tmp_path, monkeypatch):
    count = tmp_path / "count"
    fake(tmp_path, "scontrol", f'echo x >> {count}\n'
         f'if [ $(wc -l < {count}) -lt 3 ]; then echo "JobId=7 JobState=COMPLETING Reason=None ExitCode=0:15"; '
         'else echo "JobId=7 JobState=CANCELLED Reason=None ExitCode=0:15"; fi\n')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    end = job_end("7")
    assert end == JobEnd(job="7", state="CANCELLED", reason="None", exit_code="0:15")
    assert end.describe() == "Slurm job 7: CANCELLED"
    assert JobEnd(job="8", state="TIMEOUT", reason="TimeLimit").describe() == "Slurm job 8: TIMEOUT, reason TimeLimit"
    assert slurm_end(None) is None


def test_a_job_slurm_cannot_tell_about_is_unknown_and_squeue_lists_live_jobs(tmp_path, monkeypatch):
    fake(tmp_path, "scontrol", "exit 1\n")
    fake(tmp_path, "sacct", "exit 1\n")
    fake(tmp_path, "squeue", 'printf "3|RUNNING|None\\n4|PENDING|PartitionDown\\n5|COMPLETED|None\\n9|RUNNING|None\\n"\n')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}/usr/bin:/bin")
    assert job_end("3", settle_seconds=0).state == "unknown"
    assert live_jobs(["3", "4", "5", "6"]) == {"3": "RUNNING", "4": "PENDING"}  # not 9: not ours
    assert queue_states(["4"]) == {"4": ("PENDING", "PartitionDown")}  # why a pending job waits, in Slurm's words
    fake(tmp_path, "squeue", "exit 1\n")
    assert live_jobs(["3"]) is None  # squeue could not be asked: nothing is taken as ended
