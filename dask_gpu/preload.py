"""Kept name: `dask worker --preload dask_gpu.preload`, the name the docs and operators' command lines use; the code is dask_gpu.worker.preload."""

from dask_gpu.worker.preload import dask_setup  # noqa: F401,F403
