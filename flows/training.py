"""Nightly training: prepare data, train on 2 GPUs in a subprocess, evaluate, and promote only with a person's approval.

What it shows:

- `prepare_data` is a plain Prefect task: it runs in the flow process, no admission.
- `train` is an `@ai_task(gpus=2, kind="training")`: admitted (grant, budget hold sized
  from `epochs`), placed on two whole GPUs of one Dask worker, and it launches the
  trainer as a subprocess (`flows/scripts/train_step.py`) with `run_subprocess`, which
  gives it `CUDA_VISIBLE_DEVICES` for exactly those GPUs and kills it if the grant is
  revoked or the budget runs out. The checkpoint records what the process saw.
- `evaluate` takes half a GPU (`gpus=0.5`), reads the checkpoint and scores it,
  calling `dask_gpu.checkpoint()` so it can be stopped between batches.
- `promote_to_registry` is `kind="promotion"`; the example approval policy asks a person for every
  run of that kind. Against a Prefect server the flow run pauses; its form in the Prefect
  UI links the control plane's approval page, where alice signs in with her approver
  credential (or she answers `aisched approve ID --reason ...` with it, or signs with
  `--key`); an answer typed into the Prefect form itself is not counted. Run from
  its deployment (`make demo-server`, prefect.yaml) it is *suspended* instead: the
  process exits, nothing stays held, and it re-runs on its worker when answered. Only
  `alice` holds a grant with `can_approve`. A rejection, or silence for 12 hours,
  leaves the model unpromoted and the flow run still completes.

Run it locally (declared GPUs, no GPU needed; a temporary Prefect server if
PREFECT_API_URL is unset):

    .venv/bin/python -m flows.training

Without PREFECT_API_URL nobody could answer, so the example decides without a person
(the promotion is denied, as the policy says; `--no-promote` leaves it out). To answer the form yourself, run
`prefect server start` first and set `PREFECT_API_URL=http://127.0.0.1:4200/api`, or
use the deployment (`make demo-server`). Environment settings: see `flows/common.py`.

A real team replaces `train_step.py` with `torchrun --nproc-per-node=2 train.py`,
the synthetic data with their feature store, the JSON checkpoint and the registry
directory with object storage and a model registry (MLflow, W&B, ...).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import sys
from pathlib import Path
from typing import Any

from prefect import Task, flow, get_run_logger, task
from prefect.context import FlowRunContext

from aisched_prefect import AdmissionDenied, ai_task, current_devices, current_worker_name, run_subprocess, task_logger
from dask_gpu import checkpoint
from flows.common import ensure_example_blocks, example_runner, examples_home

PRINCIPAL = "examples/nightly-training"
MODEL = "examples-regressor"
TRAIN_SCRIPT = Path(__file__).with_name("scripts") / "train_step.py"
SECONDS_PER_EPOCH = 60  # what the budget hold assumes; the fake epochs take 0.2 s


def _where() -> dict[str, Any]:
    """The worker and devices this AI task holds, as the task itself sees them."""
    return {"worker": current_worker_name(), "devices": [d.key for d in current_devices()]}


@task
def prepare_data(dataset: str, rows: int, workdir: str) -> str:
    """Write the training set: y = 3x plus noise, seeded by the dataset name so every run is the same."""
    rng = random.Random(dataset)
    path = Path(workdir) / "data.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for _ in range(rows):
            x = rng.random()
            out.write(json.dumps({"x": x, "y": 3.0 * x + rng.gauss(0, 0.05)}) + "\n")
    return str(path)


def train_model(data: str, epochs: int, workdir: str) -> dict[str, Any]:
    """Run the trainer as a subprocess on this task's GPUs and return what its checkpoint says."""
    out = Path(workdir) / "checkpoint.json"
    task_logger().info("training on devices %s", [d.key for d in current_devices()])
    proc = run_subprocess([sys.executable, str(TRAIN_SCRIPT), "--data", data, "--epochs", str(epochs), "--out", str(out)],
                          capture_output=True, text=True, check=True)
    saved = json.loads(out.read_text())
    task_logger().info("trainer finished: %s", proc.stdout.strip())
    return {"checkpoint": str(out), "subprocess_saw": saved["cuda_visible_devices"], "loss": saved["loss"][-1],
            **_where()}


def train_task(gpus: int, epochs: int) -> Task[..., dict[str, Any]]:
    """The train step for this many GPUs; the hold covers SECONDS_PER_EPOCH per epoch."""
    return ai_task(gpus=gpus, kind="training", model=MODEL, est_seconds=SECONDS_PER_EPOCH * max(epochs, 1),
                   name="train")(train_model)


@ai_task(gpus=0.5, kind="evaluation", model=MODEL, est_seconds=30)
def evaluate(trained: dict[str, Any], data: str, tolerance: float = 0.1) -> dict[str, Any]:
    """Score the checkpoint: the share of rows it predicts within `tolerance`."""
    saved = json.loads(Path(trained["checkpoint"]).read_text())
    rows = [json.loads(line) for line in Path(data).read_text().splitlines() if line]
    hits = 0
    for i, row in enumerate(rows):
        if i % 128 == 0:
            checkpoint()  # a revoked grant or an exhausted budget stops the evaluation here
        hits += abs(saved["weight"] * row["x"] - row["y"]) <= tolerance
    return {"checkpoint": trained["checkpoint"], "weight": saved["weight"], "checkpoint_devices": saved["cuda_visible_devices"],
            "accuracy": hits / len(rows), "rows": len(rows), **_where()}


@ai_task(kind="promotion", model=MODEL)
def promote_to_registry(evaluation: dict[str, Any], registry: str) -> str:
    """Copy the approved checkpoint to the registry as the model's current version."""
    target = Path(registry) / MODEL / "current.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(evaluation["checkpoint"], target)
    target.with_name("evaluation.json").write_text(json.dumps(evaluation, indent=2))
    return str(target)


@flow(name="nightly-training", task_runner=example_runner(PRINCIPAL), log_prints=True)
def nightly_training(dataset: str = "synthetic-regression", epochs: int = 2, gpus: int = 2, promote: bool = True,
                     rows: int = 2048, min_accuracy: float = 0.9) -> dict[str, Any]:
    """Prepare, train on `gpus` GPUs, evaluate; promote if accuracy >= min_accuracy and a person approves."""
    log = get_run_logger()
    run_id = str(FlowRunContext.get().flow_run.id)
    workdir = str(examples_home() / "nightly-training" / run_id)
    data = prepare_data(dataset, rows, workdir)
    trained = train_task(gpus, epochs)(data, epochs, workdir)
    log.info("trained on %s devices %s; the trainer process saw CUDA_VISIBLE_DEVICES=%s",
             trained["worker"], trained["devices"], trained["subprocess_saw"])
    scores = evaluate(trained, data)
    log.info("accuracy %.3f on %d rows (evaluated on %s devices %s)", scores["accuracy"], scores["rows"],
             scores["worker"], scores["devices"])
    summary: dict[str, Any] = {"flow_run_id": run_id, "train": trained, "evaluation": scores, "promoted": None}
    if not promote:
        summary["decision"] = "promotion not requested"
    elif scores["accuracy"] < min_accuracy:
        summary["decision"] = f"accuracy {scores['accuracy']:.3f} below {min_accuracy}: not promoted"
    else:
        try:
            summary["promoted"] = promote_to_registry(scores, str(examples_home() / "registry"))
            summary["decision"] = "promoted"
        except AdmissionDenied as exc:  # rejected, or nobody answered: tonight's model stays a candidate
            summary["decision"] = f"not promoted: {exc}"
    log.info("%s", summary["decision"])
    return summary


if __name__ == "__main__":
    from flows.common import flow_args
    from flows.nightly import print_evidence

    parameters = flow_args(nightly_training)  # e.g. --epochs 5 --no-promote (--help lists them)
    logging.getLogger("distributed").setLevel(logging.WARNING)  # keep the output about the example
    ensure_example_blocks()
    result = nightly_training(**parameters)
    print(json.dumps({k: result[k] for k in ("decision", "promoted")}, indent=2))
    print_evidence(result["flow_run_id"])
