"""A batch-inference module written the way a GPU team writes one: the model is loaded once per process, at
module level behind a lock, and a callable class loads it in `__init__` (Ray Data's pattern). Each load leaves a
line in a file on a declared shared path (the test's scratch folder), so a test counts loads and processes.

Only this module's source travels to the workers (dask_gpu.body.code): its lock and model are made there.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from aisched_prefect import ai_task

_LOCK = threading.Lock()  # pickled by value, this module could not even be sent (a lock does not pickle)
_MODEL: dict | None = None


def _load(log: str, seconds: float) -> dict:
    time.sleep(seconds)  # reading weights
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\n")
    return {"pid": os.getpid(), "weights": [0.5, 2.0]}


def model(log: str, seconds: float = 0.0) -> dict:
    global _MODEL
    with _LOCK:
        if _MODEL is None:
            _MODEL = _load(log, seconds)
        return _MODEL


@ai_task(gpus=0.25, kind="batch-inference", est_seconds=30, keep_warm=30)
def score(shard: int, log: str, load_seconds: float = 0.0, crash_on: int = -1) -> dict:
    m = model(log, load_seconds)
    if shard == crash_on:
        os._exit(3)  # the body's process dies under its run
    return {"shard": shard, "score": shard * m["weights"][1], "pid": os.getpid()}


@ai_task(gpus=0.25, kind="batch-inference", est_seconds=30, keep_warm=30)
class Scorer:
    """Constructed once per warm body, called per shard."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loaded = time.time()

    def __call__(self, shard: int, log: str) -> dict:
        Path(log).open("a").write(f"{self.pid} {self.loaded}\n")
        return {"shard": shard, "pid": self.pid, "loaded": self.loaded}


@ai_task(gpus=0.25, kind="batch-inference", est_seconds=30, keep_warm=0)
def cold_score(shard: int, log: str) -> dict:
    m = model(log)
    return {"shard": shard, "pid": os.getpid(), "model_pid": m["pid"]}


@ai_task(gpus=1, kind="training", est_seconds=30)
def whole(x: int) -> int:
    return os.getpid()
