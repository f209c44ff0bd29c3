"""Fixtures of the attack tests: control planes of our own, on the session's cluster."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest


def start_plane(base: Path, plane_home: Path, scheduler: str, checkpoint_dir: Path | None = None, **env: str):
    """A second control plane on the session cluster: its own home and ledger, the session plane's signing key and
    TLS files copied in (so the workers trust its tickets and the scheduler its client)."""
    from tests.controlplane import ControlPlaneProcess

    home = base / f"plane-{uuid.uuid4().hex[:6]}"
    home.mkdir(parents=True)
    shutil.copy(plane_home / "control.key", home / "control.key")
    shutil.copytree(plane_home / "tls", home / "tls")
    return ControlPlaneProcess(home, dask_address=scheduler, dask_tls=home / "tls", env=env,
                               checkpoint_dir=checkpoint_dir).start()


@pytest.fixture(autouse=True)
def _workers_registered(request):
    """A test on the session control plane starts once all three workers registered (the control_plane fixture does
    not wait for them, and a first admission on a loaded machine found 'no workers')."""
    if "control_plane" in request.fixturenames or "own_plane" in request.fixturenames:
        request.getfixturevalue("dask_client")


@pytest.fixture
def own_plane(prefect_api, gpu_cluster, plane_home, tmp_path):
    """`own_plane(checkpoint_dir=None, **env)` -> a started ControlPlaneProcess of this test's own (stopped after)."""
    started = []

    def start(checkpoint_dir: Path | None = None, **env: str):
        started.append(start_plane(tmp_path, plane_home, gpu_cluster.scheduler_address, checkpoint_dir, **env))
        return started[-1]

    yield start
    for plane in started:
        plane.stop()
