"""`dask-gpu-worker --help` and `dask-gpu-scheduler --help` list the project's own options, then Dask's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


@pytest.mark.parametrize("command, ours, theirs", [
    ("dask-gpu-worker", ["--declared", "--trust-key", "--tls-dir", "--isolation", "--tenant ", "--body-uids",
                         "--device-nodes", "--tenant-path", "--tenant-group"], ["--nthreads", "--memory-limit"]),
    ("dask-gpu-scheduler", ["--tls-dir", "--no-tls", "--dashboard ", "--dashboard-address"], ["--port", "--host"]),
])
def test_an_entry_points_help_lists_its_own_options_and_dasks(command, ours, theirs, tmp_path):
    done = subprocess.run([str(BIN / command), "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stdout + done.stderr
    own, _, dask = done.stdout.partition("Usage:")
    assert all(option in own for option in ours), own
    assert all(option in dask for option in theirs), dask
    assert not list(tmp_path.iterdir())  # asking for help starts nothing and writes nothing
