"""A fresh body imports none of the installed modules its shipped code uses: its zygote imported them first.

Before: a body asked its zygote to import only the tops of the packages its code used (`prefect`, `aisched_prefect`);
a package imports little of itself, so each fresh body of the batch-inference example still imported `prefect.flows`,
`prefect.client.schemas` and the ledger's SQLAlchemy (0.9 s of CPU a body, 16 bodies in a 1,000-shard map).
"""

from __future__ import annotations

import importlib
import json
import sys
import uuid

import cloudpickle
import pytest

from dask_gpu.body.code import MAX_PRELOADS, preloads, ship
from dask_gpu.framing import recv_msg, send_msg
from dask_gpu.worker.zygote import Zygote

FLOW_FILE = """
import sys
BEFORE = set(sys.modules)  # what this body had when its module began: the zygote's imports and the child's own

import json
from prefect import flow, task
from prefect.context import FlowRunContext
from aisched_prefect.ledger import HOME_ENV  # a string: nothing of its module is a global here


def imported_here():
    import sys
    return sorted(set(sys.modules) - BEFORE)
"""


@pytest.fixture
def flow_file(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"flow_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(FLOW_FILE)
    importlib.invalidate_caches()
    yield importlib.import_module(name)
    sys.modules.pop(name, None)


def test_preloads_name_the_deepest_installed_modules_the_code_imports(flow_file):
    code = ship(flow_file.imported_here)
    assert code is not None
    names = preloads(code)
    assert "prefect.flows" in names and "prefect.context" in names  # where `flow` is defined; an imported module
    assert "aisched_prefect.ledger" in names  # imported for a constant: read from the source's imports
    assert "prefect" not in names  # importing prefect.flows imports prefect
    assert "json" not in names and not any(n.startswith("flow_") for n in names)  # the standard library; shipped code
    assert len(names) <= MAX_PRELOADS and names == sorted(names)


def test_a_fresh_body_imports_no_installed_module_its_zygote_was_asked_for(flow_file):
    code = ship(flow_file.imported_here)
    assert code is not None
    zygote = Zygote(tenant="t-preload")
    try:
        sock = zygote.connect(preloads(code), {})
        try:
            json.loads(recv_msg(sock))
            send_msg(sock, json.dumps({"env": {}, "code_digest": code.digest(), "devices": []}).encode())
            send_msg(sock, code.encode() + cloudpickle.dumps(((), {})))
            meta, blob = json.loads(recv_msg(sock)), recv_msg(sock)
        finally:
            sock.close()
    finally:
        zygote.close()
    assert meta["ok"], meta
    late = [m for m in cloudpickle.loads(blob) if m.split(".", 1)[0] not in sys.stdlib_module_names]
    heavy = [m for m in late if m.startswith(("prefect.flows", "prefect.client.schemas", "prefect.client.orchestration", "prefect.context", "sqlalchemy",
                                              "aisched_prefect.ledger", "distributed", "pydantic"))]
    assert heavy == [], f"the body imported what its zygote should have: {heavy[:10]}"
    # What is left is what Prefect's lazy attributes load (`from prefect import flow` imports prefect.main): a few
    # small modules (36 ms of CPU in the batch-inference example's body, against 0.9 s before).
    assert len(late) <= 30, late


def test_a_flows_module_and_its_bodys_helpers_import_no_dask():
    """The batch-inference example's module, and what a body calls (its worker's name, its devices, a subprocess that
    sees them, a refused ticket to catch), load no `distributed`: it was a second of imports in every tenant's zygote
    and in every flow process, for names a body reads from its environment."""
    import subprocess

    code = ("import sys, flows.batch_inference\n"
            "from aisched_prefect import AISchedTaskRunner, TicketRejected, ai_task, current_devices, "
            "current_worker_name, run_subprocess\n"
            "from dask_gpu import checkpoint, current_worker, gpu_env\n"
            "print(sorted(m for m in ('distributed', 'dask', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(__import__("pathlib").Path(__file__).parent.parent)).stdout.strip()
    assert out == "[]"
