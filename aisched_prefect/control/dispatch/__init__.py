"""Runs in the control plane (trusted, the only Dask client): queueing, running, settling exactly once, losses, warm bodies, the watcher, the scheduler link."""
