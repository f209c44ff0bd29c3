"""The worker's word that a run's devices are free goes to the cluster's queue as the run's Dask task finishes, in
the same batch as Dask's own `task-finished`, never while Dask still counts the task's GPUs (dask_gpu.worker.finish).
Units over a stand-in worker: its event loop runs each callback when told to, its stream is a list."""

from __future__ import annotations

from types import SimpleNamespace

from dask_gpu.worker.bodies import COLD_STREAM_OP
from dask_gpu.worker.finish import QueueMessages


class _Worker:
    def __init__(self) -> None:
        self.callbacks: list = []
        self.loop = SimpleNamespace(add_callback=lambda fn, *a: self.callbacks.append((fn, a)))
        self.state = SimpleNamespace(tasks={})
        self.batched_stream = SimpleNamespace(sent=[])
        self.batched_stream.send = self.batched_stream.sent.append

    def run_loop(self) -> None:
        while self.callbacks:
            fn, args = self.callbacks.pop(0)
            fn(*args)

    def task(self, key: str, state: str) -> None:
        self.state.tasks[key] = SimpleNamespace(state=state)


def _attached() -> tuple[QueueMessages, _Worker]:
    q, w = QueueMessages(), _Worker()
    q.attach(w)
    return q, w


def test_freed_waits_for_its_task_to_leave_executing():
    q, w = _attached()
    w.task("aisched-1", "long-running")  # a body's task secedes: long-running while its body runs
    q.freed({"op": "gpu-queue-freed", "id": "q1"}, "aisched-1")
    w.run_loop()
    assert w.batched_stream.sent == [] and len(q) == 1  # the task has not finished: Dask still counts its GPUs
    q.transition("aisched-1", "executing", "long-running")  # still running: nothing goes
    assert w.batched_stream.sent == []
    q.transition("aisched-1", "long-running", "memory")
    assert w.batched_stream.sent == [{"op": "gpu-queue-freed", "id": "q1"}] and len(q) == 0
    q.transition("aisched-1", "memory", "released")
    assert len(w.batched_stream.sent) == 1  # once


def test_freed_goes_at_once_where_its_task_is_not_running_here():
    """No key, a task unknown here, or one cancelled while its thread went on: nothing would ever flush it."""
    q, w = _attached()
    w.task("aisched-2", "cancelled")
    for key in (None, "unknown", "aisched-2"):
        q.freed({"op": "gpu-queue-freed", "id": str(key)}, key)
    w.run_loop()
    assert [m["id"] for m in w.batched_stream.sent] == ["None", "unknown", "aisched-2"] and len(q) == 0


def test_a_task_that_fails_still_frees():
    q, w = _attached()
    w.task("aisched-3", "executing")
    q.freed({"op": "gpu-queue-freed", "id": "q3"}, "aisched-3")
    w.run_loop()
    q.transition("aisched-3", "executing", "error")
    assert w.batched_stream.sent == [{"op": "gpu-queue-freed", "id": "q3"}]


def test_a_warm_body_that_ends_before_its_parking_word_went_is_freed_not_parked():
    """The word that parks body b1 warm is held; b1 ends (evicted) first: the queue must not park a body that is
    gone, so the held word frees the run's place instead, and no cold word follows for a body it never counted."""
    q, w = _attached()
    w.task("aisched-4", "long-running")
    q.freed({"op": "gpu-queue-freed", "id": "q4", "warm": "b1", "keep": 60.0}, "aisched-4")
    q.cold("b1")
    q.cold("b2")  # another warm body, parked long ago: its cold word goes at once
    w.run_loop()
    assert w.batched_stream.sent == [{"op": COLD_STREAM_OP, "body": "b2"}]
    q.transition("aisched-4", "long-running", "memory")
    assert w.batched_stream.sent[1:] == [{"op": "gpu-queue-freed", "id": "q4"}]


def test_nothing_is_sent_before_the_worker_is_attached():
    q = QueueMessages()
    q.freed({"op": "gpu-queue-freed", "id": "q5"}, "aisched-5")
    q.cold("b1")
    assert len(q) == 0
