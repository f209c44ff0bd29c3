"""docs/how-to/slurm-kubernetes.md's Slurm walk-through runs as written, in one shell, on a real one-node Slurm.

The page's marked blocks (`<!-- walk-through: STEP -->`, as tests/test_walkthrough.py reads them) run in page order
in one `bash` with HOME in a temporary folder, SLURM_CONF naming the test's own Slurm (tests/slurm_cluster.py: four
GRES gpu:h100 and one gpu:a100 stand-ins in partition `gpu`) and the page's port numbers (4200, 8786, 8787, 8790) replaced by free
ones. Between steps the test checks what a reader would see, and the ledger behind it. Skipped, with the reason,
where Slurm cannot start (a failure where AISCHED_REQUIRE_SLURM is set, as in CI).

Collected through tests/test_slurm.py (imported there: this file's name is not test_*.py). It runs beside other test
files like any slow test: each test Slurm keeps its Unix sockets in a short folder of its own (tests/slurm_cluster.py
says why: a job step's socket under an xdist tmp_path was longer than a socket path may be).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.slurm_cluster import SlurmCluster, started_or_skip
from tests.test_walkthrough import ROOT, Shell, Step, free_port, steps

PAGE = ROOT / "docs" / "how-to" / "slurm-kubernetes.md"
PORTS = (4200, 8786, 8787, 8790)

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.timeout(1200)]


def test_the_page_marks_its_slurm_walk_through():
    assert [s.name for s in steps(PAGE)] == ["cluster", "scaler", "configure", "flow", "file from_zero.py",
                                             "from-zero", "give-back", "file train_retry.py", "scancel", "stop"]


def test_the_slurm_walk_through_runs_as_written(tmp_path):
    slurm = SlurmCluster(tmp_path / "slurm", gpus=4, gpu_type="h100", more_types=(("a100", 1),))
    started_or_skip(slurm)
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "dask-scratch").mkdir()
    ports = {p: free_port() for p in PORTS}
    env = {k: v for k, v in slurm.env().items()
           if not k.startswith(("AISCHED_", "PREFECT_", "DASK_GPU_", "DASK_DASK_GPU__ISOLATION", "PYTEST_"))}
    env.update(HOME=str(home), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=str(ROOT), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
               DASK_TEMPORARY_DIRECTORY=str(tmp_path / "dask-scratch"))
    env.pop("VIRTUAL_ENV", None)
    shell = Shell(tmp_path, env)
    done: dict[str, str] = {}
    timeouts = {"cluster": 240, "scaler": 240, "configure": 420, "flow": 420, "from-zero": 420, "give-back": 120,
                "scancel": 420, "stop": 120}
    demo = home / "aisched-slurm"

    def run(step: Step) -> str:
        code = step.code
        for page_port, port in ports.items():
            code = re.sub(rf"\b{page_port}\b", str(port), code)
        done[step.name], _ = shell.run(step, code, timeouts[step.name])
        return done[step.name]

    try:
        for step in steps(PAGE):
            if step.name.startswith("file "):
                (demo / step.name.split(" ", 1)[1]).write_text(step.code)
                continue
            out = run(step)
            if step.name == "scaler":
                assert re.search(r"h100-examples-\S+ \(Slurm job \d+\)", out) and re.search(r"\d+ +gpu +dask-gpu +\S+ +R ", out), out
            elif step.name == "flow":
                _check_flow(out, demo, home)
            elif step.name == "from-zero":
                _check_from_zero(out, home)
            elif step.name == "give-back":
                assert re.search(r"gave back Slurm job \d+", out), out
            elif step.name == "scancel":
                _check_scancel(out, home)
        assert "stopped" in done["stop"] and slurm.jobs() == [], (done["stop"], slurm.jobs())
    except BaseException:
        print("---- the shell's output\n" + "".join(shell.transcript[-80:]))
        for name in ("slurm", "serve", "scheduler", "batch-inference", "train"):
            f = demo / f"{name}.log"
            if f.exists():
                print(f"---- {f.name} (last lines)\n" + "".join(f.read_text().splitlines(True)[-30:]))
        print(slurm.logs())
        raise
    finally:
        shell.close()
        slurm.close()


def _ledger(home: Path):
    from aisched_prefect.ledger import Ledger

    return Ledger(f"sqlite:///{home / '.aisched' / 'ledger.db'}")


def _check_flow(out: str, demo: Path, home: Path) -> None:
    """Every shard settled on a worker job, named in the evidence; the scaler submitted jobs for what waited."""
    assert len(re.findall(r"submitted Slurm job \d+", out)) >= 2, out  # min_jobs, then one for the waiting shards
    settled = [r.payload for r in _ledger(home).records() if r.kind == "settlement" and r.payload.get("task") == "infer"]
    assert len(settled) == 8 and all(s["outcome"] == "completed" for s in settled), settled
    assert all(s["placement"].get("slurm_job") for s in settled), [s["placement"] for s in settled]
    assert "(Slurm job" in out, out


def _check_from_zero(out: str, home: Path) -> None:
    """No worker had an A100: the run waited for capacity, started on the job submitted for it, and completed."""
    assert "waits for capacity: a worker of Slurm group a100-examples" in out, out
    assert re.search(r"embed waited for capacity: a Slurm job of group a100-examples was submitted: job \d+", out), out
    assert re.search(r"embedded 1000 rows on a100-examples-\S+", out), out
    job = re.search(r"submitted Slurm job (\d+) \(a100-examples-", out)
    assert job, out
    settled = [r.payload for r in _ledger(home).records() if r.kind == "settlement" and r.payload.get("task") == "embed"]
    assert [s["outcome"] for s in settled] == ["completed"] and settled[0]["placement"]["slurm_job"] == job.group(1)


def _check_scancel(out: str, home: Path) -> None:
    """The cancelled job's run: one worker-died record with Slurm's CANCELLED, charged once, retried on another job."""
    records = _ledger(home).records()
    died = [r for r in records if r.kind == "worker-died"]
    assert len(died) == 1, [r.kind for r in records]
    slurm = died[0].payload["slurm"]
    assert slurm["state"] == "CANCELLED", slurm
    settled = [r.payload for r in records if r.kind == "settlement" and r.task_run_id == died[0].task_run_id]
    assert [s["outcome"] for s in settled] == ["worker-died", "completed"], settled
    assert settled[1]["placement"]["slurm_job"] != slurm["job"]
    assert re.search(r"trained 20 steps on h100-examples-", out), out
    assert "worker-died (Slurm job" in out and "CANCELLED)" in out, out  # the table may wrap the decision
