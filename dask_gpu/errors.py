"""Named errors of the resource layer; each message says what to change."""

from __future__ import annotations


class DaskGPUError(Exception):
    """Base class for every error raised by dask_gpu."""


class TicketRejected(DaskGPUError):
    """A worker refused to run a body: its ticket is missing, untrusted, altered, expired or already used.
    (Here, not beside the tickets: a flow's process catches it and must not import Dask to do so.)"""


class InventorySpecError(DaskGPUError, ValueError):
    """A declared GPU inventory could not be parsed."""


class InfeasibleRequest(DaskGPUError):
    """No worker of the cluster could ever hold this request."""


class DeviceUnavailable(DaskGPUError):
    """A worker could not give a task the devices Dask admitted it for."""


class MessageTooLarge(DaskGPUError, ValueError):
    """A peer announced a message larger than it may send (a body's result past its own memory bound)."""


class MessageRefused(DaskGPUError, ValueError):
    """A peer handed over something other than a sealed memory file of the size it announced."""


class NotOnGPUWorker(DaskGPUError):
    """Code that needs a GPU-aware worker ran somewhere else."""


class StopRequested(DaskGPUError):
    """The task was asked to stop (its authority was revoked, or it was preempted)."""


class WorkerDied(DaskGPUError):
    """The worker running a task died under it (the message names the worker and the devices lost)."""


class ShippedCodeTooLarge(DaskGPUError, ValueError):
    """A task's package is too large to travel with every call as source (the message names the limit and the fix)."""


class RunFailedOnWorker(DaskGPUError):
    """A run handed over to a worker failed there with an OS error (its body's set-up: a fork, a cgroup, a network
    namespace); sent back as this, so its caller does not take it for its own connection to the worker breaking."""
