"""The records a run crosses the worker's boundary with: the `Body` the control plane sends with a ticket, and the
`Outcome` (with its `BodyInfo`) it gets back. Their own module so that the steps of a run (dask_gpu.worker.life) and
the task function that calls them (dask_gpu.worker.sandbox) both read them without importing each other."""

from __future__ import annotations

import pickle
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from dask_gpu.worker.execute import DeviceRun
from dask_gpu.worker.results import ResultRef


class BodyInfo(BaseModel):
    """Which body process ran a run, and how: the evidence that a model was loaded once per body."""

    model_config = ConfigDict(frozen=True)

    id: str
    start: Literal["cold", "warm"]  # a fresh process, or a warm body of the same key that ran earlier runs
    runs: int = 1  # the runs this body has run, this one included
    idle_before: float = 0.0  # a warm start: how long the body waited idle for this run
    setup_seconds: float = 0.0  # how long loading the code took in this run (a cold start's import, a class's __init__)
    kept: bool = False  # it stays warm after this run, for `keep` seconds at most
    keep: float = 0.0
    peak_memory_mb: float | None = None  # its cgroup's peak memory so far (None: no cgroup)


class Outcome(BaseModel):
    """How one body ended, and where it ran. `value` and `error` are pickled bytes nobody here opens; a large value
    stays on its worker and `result` says where (then `value` is empty)."""

    model_config = ConfigDict(frozen=True)

    ok: bool
    value: bytes = b""
    result: ResultRef | None = None
    error: bytes = b""
    error_type: str = ""
    error_message: str = ""
    error_text: str = ""
    stopped: str | None = None  # why it was stopped: "stop requested", "lease expired", ...
    run: DeviceRun
    member: int = 0  # which member of a gang this was (0 for a run on one host)
    logs: list[tuple[int, str]] = []
    reports: list[dict[str, Any]] = []
    body: BodyInfo | None = None  # which body ran it (None: it never reached one)


class Body(BaseModel):
    """What the control plane sends with a ticket: the pickled call and what its child needs to start warm."""

    model_config = ConfigDict(frozen=True)

    payload: bytes
    modules: list[str] = []
    env: dict[str, str] = {}
    member: int = 0  # gang runs: which member this is (0 .. hosts-1)
    devices: list[str] | None = None  # the device keys the cluster's queue chose for it (None: the worker chooses)
    queue_key: str | None = None  # its key in the cluster's queue: told the devices are free the moment the body ends
    warm_body: str | None = None  # the idle warm body the cluster's queue chose for it (None: a body of its own)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        """The payload travels beside the pickle (out of band, protocol 5) where the pickler takes buffers: Dask
        pickles a task again with cloudpickle, at several times the cost, whenever its pickle's bytes hold
        `__main__`, and a flow file's shipped source (its `if __name__ == "__main__":`) always does."""
        payload = pickle.PickleBuffer(self.payload) if isinstance(protocol, int) and protocol >= 5 else self.payload
        return (_body, (payload, self.model_dump(exclude={"payload"})))


def _body(payload: Any, fields: dict[str, Any]) -> Body:
    return Body(payload=bytes(payload), **fields)
