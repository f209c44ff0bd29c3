"""Batch inference: shards fanned out with `.map()` over fractional GPUs, results gathered in one task.

What it shows:

- `make_shards` (a plain task) splits the input into `shards` shards.
- `infer` is an `@ai_task(gpus=gpu_fraction, kind="inference")`, mapped over the shards:
  each run is admitted and held on its own budget line. With the default quarter of a
  GPU, four shards fit on one device at once, and the worker's allocator packs
  fractions onto the fullest device that still fits, keeping whole GPUs free for
  whole-GPU work: the 8 shards land on one device per worker, 4 each. (How many run
  at the same instant is also bounded by the worker's threads: 3 on the embedded
  2-GPU workers.) Each shard records the device it got and when it ran.
- `gather` (a plain task) checks every shard came back, and reports how many shards
  each device served and how many ran on one device at the same time.

Run it locally (declared GPUs, no GPU needed):

    .venv/bin/python -m flows.batch_inference

The model is loaded the way a GPU team loads one: once per process, at module level behind
a lock (`load_model`). This module reaches the workers as its source, and each shard's body
stays *warm* after its run (5 minutes by default for inference kinds, `keep_warm=`): the next
shard of the same task, principal and request runs in it, so the model is loaded once per
body, not once per shard (at most 4 bodies per GPU at a quarter each). Each shard is still
admitted, held, placed, settled and recorded on its own; the time a warm body waits idle on
its device share is charged as `warm-idle`. A real team replaces `StandInModel` with a
`torch.load` or a vLLM engine onto `current_devices()`, and the rows with data read from a
shared path or object storage; `gpu_memory_gb=` then reserves the memory the model needs on
the shared GPU. Environment settings: see `flows/common.py`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import uuid
from typing import Any

from prefect import Task, flow, get_run_logger, task, unmapped
from prefect.context import FlowRunContext

from aisched_prefect import ai_task, current_devices, current_worker_name
from flows.common import ensure_example_blocks, example_runner

PRINCIPAL = "examples/batch-inference"
MODEL = "examples-regressor"


@task
def make_shards(shards: int, rows_per_shard: int) -> list[dict[str, Any]]:
    """Split the input into shards; here the rows are just their numbers."""
    return [{"shard": i, "rows": list(range(i * rows_per_shard, (i + 1) * rows_per_shard))} for i in range(shards)]


class StandInModel:
    """What a team loads once per process (weights onto its GPU); here a name, and `load_seconds` of loading.
    Each load appends its process's mark to `load_log` (a file on a path every worker shares), so loads can be
    counted: a random mark, not the pid, since every isolated body is pid 1 or 2 in a PID namespace of its own."""

    def __init__(self, name: str, load_seconds: float = 0.0, load_log: str | None = None) -> None:
        time.sleep(load_seconds)
        self.name, self.pid, self.process = name, os.getpid(), uuid.uuid4().hex[:12]
        if load_log:
            with open(load_log, "a") as f:
                f.write(f"{self.process}\n")

    def score(self, row: int) -> float:
        return int(hashlib.sha256(f"{self.name}:{row}".encode()).hexdigest()[:8], 16) % 1000 / 1000


_MODELS: dict[str, StandInModel] = {}
_MODELS_LOCK = threading.Lock()


def load_model(name: str, load_seconds: float = 0.0, load_log: str | None = None) -> StandInModel:
    """The process's one copy of model `name`, loaded on first use."""
    with _MODELS_LOCK:
        if name not in _MODELS:
            _MODELS[name] = StandInModel(name, load_seconds, load_log)
        return _MODELS[name]


def score_shard(shard: dict[str, Any], model: str, seconds: float, load_seconds: float = 0.0,
                load_log: str | None = None) -> dict[str, Any]:
    """Score one shard on this task's share of a GPU with the process's loaded model."""
    started = time.time()
    device = current_devices()[0]
    scorer = load_model(model, load_seconds, load_log)
    scores = [scorer.score(row) for row in shard["rows"]]
    time.sleep(seconds)  # the model's forward passes
    return {"shard": shard["shard"], "rows": len(scores), "mean_score": sum(scores) / len(scores),
            "worker": current_worker_name(), "device": device.key, "gpu_type": device.gpu_type,
            "started": started, "ended": time.time(), "pid": os.getpid(), "process": scorer.process}


def infer_task(gpu_fraction: float, seconds: float, model: str) -> Task[..., dict[str, Any]]:
    """The inference step on `gpu_fraction` of a GPU; its hold covers 30 s more than the shard takes."""
    return ai_task(gpus=gpu_fraction, kind="inference", model=model, est_seconds=seconds + 30, name="infer")(score_shard)


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The largest number of these (start, end) spans that overlap at one instant."""
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


@task
def gather(results: list[dict[str, Any]], shards: int) -> dict[str, Any]:
    """Check every shard came back; summarise the scores and how the shards shared devices."""
    missing = sorted(set(range(shards)) - {r["shard"] for r in results})
    if missing:
        raise ValueError(f"shards {missing} returned no result")
    by_device: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_device.setdefault(f"{r['worker']}/{r['device']}", []).append(r)
    return {
        "shards": len(results), "rows": sum(r["rows"] for r in results),
        "mean_score": sum(r["mean_score"] * r["rows"] for r in results) / sum(r["rows"] for r in results),
        "devices": {d: {"shards": sorted(r["shard"] for r in rs),
                        "most_at_once": most_at_once([(r["started"], r["ended"]) for r in rs])}
                    for d, rs in sorted(by_device.items())},
        "results": sorted(results, key=lambda r: r["shard"]),
        "processes": len({r["process"] for r in results}),  # each loads the model once: its mark names it
        "flow_run_id": str(FlowRunContext.get().flow_run.id),
    }


@flow(name="batch-inference", task_runner=example_runner(PRINCIPAL), log_prints=True)
def batch_inference(shards: int = 8, gpu_fraction: float = 0.25, rows_per_shard: int = 1000,
                    seconds_per_shard: float = 1.0, model: str = MODEL, load_seconds: float = 0.0,
                    load_log: str | None = None) -> dict[str, Any]:
    """Score `shards` shards, each on `gpu_fraction` of a GPU, and gather the results. `load_seconds`: how long the
    model takes to load in each process that loads it; `load_log`: a file on a shared path each load is noted in."""
    log = get_run_logger()
    parts = make_shards(shards, rows_per_shard)
    futures = infer_task(gpu_fraction, seconds_per_shard, model).map(
        parts, model=unmapped(model), seconds=unmapped(seconds_per_shard), load_seconds=unmapped(load_seconds),
        load_log=unmapped(load_log))
    summary = gather(futures, shards)
    for device, use in summary["devices"].items():
        log.info("device %s served shards %s, at most %d at once", device, use["shards"], use["most_at_once"])
    return summary


if __name__ == "__main__":
    from flows.common import flow_args
    from flows.nightly import print_evidence

    parameters = flow_args(batch_inference)  # e.g. --shards 300 --gpu-fraction 0.5 (--help lists them)
    logging.getLogger("distributed").setLevel(logging.WARNING)  # keep the output about the example
    ensure_example_blocks()
    state = batch_inference(**parameters, return_state=True)
    result = state.result()
    print(json.dumps({k: result[k] for k in ("shards", "rows", "mean_score", "devices")}, indent=2))
    print_evidence(str(state.state_details.flow_run_id))
