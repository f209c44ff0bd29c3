"""Dask nanny preload: `dask worker ADDR --nanny --preload-nanny dask_gpu.worker.nanny_preload`.

A nanny answers `run` (it executes a pickled function), `kill`, `restart` and
`plugin_add`, just as a worker does: on TLS it gets the same default-deny gate
(dask_gpu.gate), so only the scheduler and the control plane may ask for them.
`dask-gpu-worker` and LocalGPUCluster start every nanny with it.
"""

from __future__ import annotations

from typing import Any

from dask_gpu.gate import gate_nanny


def dask_setup(nanny: Any) -> None:
    gate_nanny(nanny)
