"""A worker's word to the cluster's queue that a run's devices are free: sent as its Dask task finishes, not before.

Why: a one-host run frees its place in the queue as its body ends, so the next run does not wait for the control
plane to fetch this one's result and leave (`dask_gpu.scheduler.stream`). Told from the task's thread while the
task still ran, the queue could start the next run, and the control plane hand it to Dask, while Dask still counted
this task's GPUs on the worker: on a loaded host the next run then waited inside Dask behind a run that had already
ended, and Dask held more GPUs there than the worker has. Told as the task leaves `executing` (the worker plugin's
`transition` hook, on the worker's event loop), the word goes on the worker's stream just before Dask's own
`task-finished`, which the scheduler handles in the same batch: the next run, a round trip through the control
plane later, finds Dask's count already down. Every step after the hop onto the event loop runs there: no lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dask_gpu.worker.bodies import COLD_STREAM_OP

if TYPE_CHECKING:
    from distributed import Worker

RUNNING_STATES = frozenset({"executing", "long-running"})  # a task's states on the worker while its thread runs


class QueueMessages:
    """The queue's `freed` and `cold` messages from this worker, on its batched stream, in the order that is true."""

    def __init__(self) -> None:
        self._worker: Worker | None = None
        self._held: dict[str, list[dict[str, Any]]] = {}  # task key -> messages sent as it finishes

    def attach(self, worker: Worker) -> None:
        self._worker = worker

    def freed(self, msg: dict[str, Any], task: str | None) -> None:
        """From any thread: `msg` goes when Dask task `task` finishes here; at once where it is not running here
        (no key, or it was cancelled or released while its thread went on)."""
        self._on_loop(self._later, task, msg)

    def cold(self, body: str) -> None:
        """From any thread: a warm body the queue counts ended. Where the message that parks it is still held, that
        message frees the run's place instead (the queue must not park a body that is gone)."""
        self._on_loop(self._cold, body, {"op": COLD_STREAM_OP, "body": body})

    def transition(self, key: str, start: str, finish: str) -> None:
        """On the event loop (the worker plugin's hook): what was held for `key` goes as it leaves a running state."""
        if start in RUNNING_STATES and finish not in RUNNING_STATES:
            for msg in self._held.pop(key, ()):
                self._send(msg)

    def __len__(self) -> int:
        return len(self._held)

    def _on_loop(self, step: Any, key: str | None, msg: dict[str, Any]) -> None:
        if self._worker is not None:
            self._worker.loop.add_callback(step, key, msg)

    def _later(self, key: str | None, msg: dict[str, Any]) -> None:
        task = self._worker.state.tasks.get(key) if key is not None and self._worker is not None else None
        if task is None or task.state not in RUNNING_STATES:
            self._send(msg)
        else:
            self._held.setdefault(key, []).append(msg)  # type: ignore[arg-type]

    def _cold(self, body: str, msg: dict[str, Any]) -> None:
        for held in self._held.values():
            for m in held:
                if m.get("warm") == body:
                    m.pop("warm")
                    m.pop("keep", None)
                    return
        self._send(msg)

    def _send(self, msg: dict[str, Any]) -> None:
        stream = getattr(self._worker, "batched_stream", None)
        if stream is not None:
            stream.send(msg)
