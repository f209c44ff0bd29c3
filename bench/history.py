"""Costs that must not grow with history: admission against 10x more grants, a flow run's end against 10x more evidence.

Admission runs in-process on a fresh SQLite ledger (the control plane's own
admission pipeline and authority state, a declared inventory, no HTTP or Dask), with an
applied authority of N root grants and N grants delegated through the API's
path, N/10 of them revoked. The flow run's end is what the control plane does
when a runner closes: read that flow run's records, build its usage artifact
(into a stand-in Prefect client), against a day that holds M other runs.

    .venv/bin/python bench/history.py          # prints both, at 1x and 10x
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aisched_prefect.control.authority import records
from aisched_prefect.control.admission.pipeline import Pipeline
from aisched_prefect.control.authority.identity import new_credential
from aisched_prefect.control.authority.state import AuthorityState, block_body, content_digest
from aisched_prefect.ledger import Ledger
from aisched_prefect.request import AIRequest
from aisched_prefect.reports.usage import publish_flow_run_artifact
from aisched_prefect.wire import CallMeta
from blocks import AuthorityBlock, BudgetBlock, Grant

MINE = "00000000-0000-0000-0000-000000000001"


def _inventories() -> dict[str, Any]:
    from dask_gpu.inventory import GPUDevice, WorkerInventory

    devices = tuple(GPUDevice(index=i, uuid=f"GPU-{i}", name="H100", gpu_type="H100", memory_gb=80) for i in range(4))
    return {"w0": WorkerInventory(devices=devices), "w1": WorkerInventory(devices=devices)}


def _apply(ledger: Ledger, kind: str, name: str, block: Any) -> None:
    body = block_body(block)
    records.record(ledger, records.ConfigApplied(config_kind=kind, name=name, version=1, digest=content_digest(body),
                                                 body=body, by="bench"))


def admission_ms(grants: int, calls: int = 300) -> float:
    ledger = Ledger(f"sqlite:///{tempfile.mkdtemp()}/ledger.db")
    roots = [Grant(id=f"root-{i}", principal=f"team-{i}/flow", max_gpus=4, max_cost_per_run=10, can_delegate=True)
             for i in range(grants)]
    _apply(ledger, "authority", "big", AuthorityBlock(grants=roots))
    _apply(ledger, "budget", "big", BudgetBlock(limit=1e9, gpu_hour_prices={"*": 1.0}))
    for i in range(grants):
        child = roots[i].model_copy(update={"id": f"child-{i}", "principal": f"team-{i}/child", "parent": roots[i].id,
                                            "can_delegate": False, "max_gpus": 1})
        records.record(ledger, records.Delegation(grant=child, by=f"team-{i}/flow"))
        if i % 10 == 0:
            records.record(ledger, records.Revocation(grant=f"child-{i}", authority="big", by="bench", reason="bench"))
    _, cred = new_credential(principal="team-7/child", tenant="team-7", role="flow", created_by="bench",
                             authority="big", budget="big")
    records.record(ledger, records.CredentialIssued(credential=cred, by="bench"))
    state = AuthorityState(ledger)
    pipeline = Pipeline(ledger, state, lambda fresh: _inventories())
    request = AIRequest.build(kind="inference", gpus=1, est_seconds=1)
    times = []
    for i in range(calls):
        meta = CallMeta(task_name="t", task_run_id=str(uuid.uuid4()), flow_run_id="f", run_key=f"f/{i}",
                        request=request.model_dump(mode="json"), code_digest="0" * 64, args_offset=1)
        t0 = time.perf_counter()
        pipeline.admit(cred, meta, request, "p", "a")
        times.append(time.perf_counter() - t0)
    ledger.close()
    return 1000 * statistics.median(times[len(times) // 5:])  # after warm-up


class _Artifacts:
    """Stands in for Prefect's client: takes the artifact, asks nothing."""

    def create_artifact(self, artifact: Any) -> None:
        self.last = artifact

    def read_flow_runs(self, **_: Any) -> list[Any]:
        return []

    def read_flows(self, **_: Any) -> list[Any]:
        return []


def flow_run_end_ms(other_runs: int, repeats: int = 20) -> float:
    ledger = Ledger(f"sqlite:///{tempfile.mkdtemp()}/ledger.db")
    from blocks import BudgetLine

    line = BudgetLine(budget="org", period="2026-11", limit=1e9, amount=0.01)
    for i in range(other_runs + 1):
        flow_run = MINE if i == 0 else f"f-{i % 50}"
        held, _ = ledger.reserve([line], kind="admission", payload={"task": "t", "flow": "f", "request": {"kind": "inference"}},
                                 flow_run_id=flow_run, task_run_id=f"t-{i}", principal="team-a/x")
        ledger.settle([h.id for h in held], 0.005, kind="settlement", payload={"task": "t", "flow": "f", "outcome": "completed"},
                      flow_run_id=flow_run, task_run_id=f"t-{i}", principal="team-a/x")
    client = _Artifacts()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ledger.records(MINE)
        publish_flow_run_artifact(ledger, MINE, client=client)
        times.append(time.perf_counter() - t0)
    ledger.close()
    return 1000 * statistics.median(times)


def main() -> None:
    print("admission (median ms, in-process: stages, authority fold, budget hold + record)")
    small, big = admission_ms(300), admission_ms(3000)
    print(f"  300 grants (+300 delegated, 30 revoked):    {small:6.2f} ms")
    print(f"  3000 grants (+3000 delegated, 300 revoked): {big:6.2f} ms   ratio {big / small:.2f} (flat: ~1)")
    print("a flow run's end (median ms: its records and its usage artifact)")
    small, big = flow_run_end_ms(500), flow_run_end_ms(5000)
    print(f"  day of 500 other runs:  {small:6.2f} ms")
    print(f"  day of 5000 other runs: {big:6.2f} ms   ratio {big / small:.2f} (flat: ~1)")


if __name__ == "__main__":
    main()
