"""The worker's cgroup policy over its bodies (dask_gpu.worker.containment), on this host's real cgroups."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest

from dask_gpu.worker.containment import sweep_stale
from dask_gpu.isolation.cgroups import BodyCgroup, Limits, cgroups_available

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or cgroups_available() is not None,
                                reason=f"needs root and writable cgroups ({cgroups_available()})")


def test_a_dead_workers_empty_body_cgroups_are_swept_and_live_ones_kept():
    root = f"aisched-test-{uuid.uuid4().hex[:8]}"
    stale = BodyCgroup("body-stale", Limits(pids=16), root=root)
    busy = BodyCgroup("body-busy", Limits(pids=16), root=root)
    fresh = BodyCgroup("body-fresh", Limits(pids=16), root=root)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        busy.add(sleeper.pid)
        for cg in (stale, busy):  # made a while ago
            for d in cg.dirs.values():
                os.utime(d, (0, 0))
        removed = sweep_stale(60.0, root=root)
        assert removed == len(stale.dirs)  # the empty old one, in every controller
        assert not any(os.path.isdir(d) for d in stale.dirs.values())
        assert all(os.path.isdir(d) for d in (*busy.dirs.values(), *fresh.dirs.values()))  # in use; just made
    finally:
        sleeper.kill()
        sleeper.wait()
        for cg in (busy, fresh, stale):
            cg.remove()
        for d in {os.path.dirname(p) for cg in (busy, fresh) for p in cg.dirs.values()}:
            try:
                os.rmdir(d)
            except OSError:
                pass
