"""A small nightly pipeline: prepare data, train on 2 GPUs, batch inference on 1 GPU per shard, report.

Runs on the embedded default: a local Dask cluster of GPU-aware workers (the
GPUs NVML finds, or the declared inventory below on a machine without them),
the Prefect API in PREFECT_API_URL (or Prefect's temporary local server), and
a SQLite ledger. `make demo` runs it.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from prefect import flow, get_run_logger, task, unmapped
from prefect.context import FlowRunContext
from rich.console import Console
from rich.table import Table

from aisched_prefect import (
    AISchedTaskRunner,
    Ledger,
    ai_task,
    current_devices,
    current_worker_name,
    evidence_rows,
    run_subprocess,
    task_logger,
)
from aisched_prefect.reports.runs import MONEY_NOTE, for_display
from blocks import ApprovalPolicyBlock, ApprovalRule, AuthorityBlock, BudgetBlock, BudgetLimit, Grant

DECLARED = os.environ.get("DASK_GPU_DECLARED", "2 workers x 2 GPUs, 80 GB, H100")


def where() -> dict:
    """What this task holds, as the task itself sees it (it runs in its own process on its worker)."""
    return {"worker": current_worker_name(), "devices": [d.index for d in current_devices()], "pid": os.getpid()}


@task
def prepare_data(n_shards: int) -> list[list[int]]:
    return [list(range(i * 10, i * 10 + 10)) for i in range(n_shards)]


@ai_task(gpus=2, gpu_type="H100", kind="training", model="demo-embedder", est_seconds=20)
def train(shards: list[list[int]]) -> dict:
    task_logger().info("training on devices %s", [d.key for d in current_devices()])  # shows in the Prefect UI
    # A real trainer is a subprocess (torchrun, deepspeed) that must see exactly its GPUs.
    seen = run_subprocess([sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    time.sleep(1.0)
    return {"weights": sum(map(sum, shards)), "subprocess_saw": seen, **where()}


@ai_task(gpus=1, gpu_memory_gb=16, kind="inference", model="demo-embedder", est_seconds=5)
def embed(shard: list[int], model: dict) -> dict:
    time.sleep(0.5)
    return {"shard": shard[0] // 10, "score": sum(shard) * model["weights"] % 97, **where()}


@task
def report(model: dict, results: list[dict]) -> None:
    log = get_run_logger()
    log.info("train ran on %s devices %s (its subprocess saw CUDA_VISIBLE_DEVICES=%s)",
             model["worker"], model["devices"], model["subprocess_saw"])
    for r in results:
        log.info("embed shard %d ran on %s devices %s", r["shard"], r["worker"], r["devices"])


@flow(
    name="nightly-demo",
    task_runner=AISchedTaskRunner(
        principal="team-a/nightly", authority="team-a", budget="team-a",
        approval_policy="team-a", approver="policy", declared=DECLARED,
    ),
)
def nightly(n_shards: int = 4) -> str:
    shards = prepare_data(n_shards)
    model = train(shards)
    results = [f.result() for f in embed.map(shards, model=unmapped(model))]
    report(model, results)
    return str(FlowRunContext.get().flow_run.id)


def save_demo_blocks() -> None:
    """The operator's side: what a person would set up once in the Prefect UI."""
    AuthorityBlock(grants=[
        Grant(id="team-a-root", principal="group:team-a", kinds=["training", "inference"],
              gpu_types=["H100"], max_gpus=4, max_cost_per_run=5.0),
    ], groups={"team-a": ["team-a/nightly"]}).save("team-a", overwrite=True)
    BudgetBlock(limit=100.0, period="monthly", gpu_hour_prices={"H100": 4.0}, limits=[
        BudgetLimit(name="tenant", scope="tenant", match="team-a", amount=50.0),
        BudgetLimit(name="nightly", scope="flow", match="nightly-*", amount=20.0, parent="tenant"),
        BudgetLimit(name="h100-hours", unit="gpu-hours", scope="gpu-type", match="H100", amount=10.0,
                    period="weekly", window="rolling"),
    ]).save("team-a", overwrite=True)
    ApprovalPolicyBlock(rules=[
        ApprovalRule(name="multi-gpu-training", kinds=["training"], min_gpus=2, action="approve"),
        ApprovalRule(name="expensive", min_cost=2.0, action="ask"),
    ]).save("team-a", overwrite=True)


def print_evidence(flow_run_id: str) -> None:
    ledger = Ledger()
    rows = [for_display(r) for r in evidence_rows(ledger.records(flow_run_id))]
    table = Table(title=f"Evidence of flow run {flow_run_id}")
    columns = ["task", "request", "grant", "worker", "devices", "reserved", "charged", "decision"]
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*(r[c] for c in columns))
    console = Console(width=200)
    console.print(table)
    console.print(MONEY_NOTE)
    report = ledger.verify()
    console.print(f"evidence chain: {'intact' if report.ok else 'BROKEN'} ({report.records} records) in {ledger.url}")
    for account in ledger.accounts():
        unit = "USD" if account["unit"] == "money" else account["unit"]
        console.print(f"budget {account['budget']} {account['period']}: posted {account['posted']:.4f} of "
                      f"{account['limit']:.2f} {unit}, remaining {account['remaining']:.4f}")


if __name__ == "__main__":
    logging.getLogger("distributed").setLevel(logging.WARNING)  # keep the demo's output about the demo
    save_demo_blocks()
    print_evidence(nightly())
