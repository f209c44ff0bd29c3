"""Runs in a Dask client's process (a user's script, the control plane): a local GPU cluster, and reading and steering a running one; trusts what the scheduler answers."""
