"""Runs in the Dask scheduler (trusted by the workers' gate): the cluster's one queue and its parts, per-model call limits, the scheduler's preload and command."""
