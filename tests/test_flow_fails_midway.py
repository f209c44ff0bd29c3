"""A flow that fails while its AI tasks still run or wait: its process ends, and so does every task run it began.

Found with bench/fanout.py: a flow whose code raised while hundreds of its shards still waited left them pending on the
runner's loop; at exit each was destroyed mid-await, Prefect's engine logged from inside the dying coroutine, and the
process hung in interpreter shutdown, forever, with its task runs still Running in Prefect.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from tests.helpers import tenant

REPO = Path(__file__).parent.parent


WAITING = """
    futures = shard.map(range(12))  # more than the cluster runs at once: some run, the rest wait
    while not Path(STARTED).exists():
        time.sleep(0.1)
    raise RuntimeError("the flow's own code failed while its shards ran and waited")
"""
FAILING = """
    futures = broken.map(range(400))  # each fails at once: the flow gives up on the first
    futures[0].wait()
    raise RuntimeError("the flow's own code failed while its shards ran and waited")
"""


@pytest.mark.parametrize("body", [WAITING, FAILING], ids=["shards-wait", "shards-fail-fast"])
def test_a_flow_that_raises_while_its_shards_wait_ends_its_process_and_every_task_run(control_plane, tmp_path, body):
    from prefect.settings import PREFECT_API_URL

    t = tenant(control_plane)
    started, run_file = tmp_path / "started", tmp_path / "flow-run"
    script = tmp_path / f"failing-{uuid.uuid4().hex[:6]}.py"
    script.write_text(f'''
import time
from pathlib import Path
from prefect import flow
from prefect.context import FlowRunContext
from aisched_prefect import AISchedTaskRunner, ai_task

STARTED = {str(started)!r}

@ai_task(gpus=0.25, kind="inference", est_seconds=120)
def shard(i):
    Path({str(started)!r}).write_text("x")
    time.sleep(20)
    return i

@ai_task(gpus=0.25, kind="inference", est_seconds=120)
def broken(i):
    raise ValueError(f"shard {{i}} is broken")

@flow(task_runner=AISchedTaskRunner(control_plane={control_plane.url!r}, credential={t.token!r}))
def failing():
    Path({str(run_file)!r}).write_text(str(FlowRunContext.get().flow_run.id))
{body}
failing()
''')
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_LOGGING_LEVEL": "ERROR",
           "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)  # our own child, by its process group
            proc.wait()
    assert proc.returncode == 1, err.decode()[-2000:]
    assert b"the flow's own code failed" in err
    flow_run_id = uuid.UUID(run_file.read_text())
    deadline, unfinished = time.time() + 60, ["not read yet"]
    while unfinished and time.time() < deadline:  # Prefect records a task run's states from its events, a little later
        with get_client(sync_client=True) as client:
            assert client.read_flow_run(flow_run_id).state.is_failed()
            runs, page = [], [None]
            while page:  # the API gives at most 200 a page
                page = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                                             limit=200, offset=len(runs))
                runs += page
        assert runs, "no task run began"
        unfinished = [(r.name, r.state and r.state.type.value) for r in runs if r.state is None or not r.state.is_final()]
        time.sleep(0.5)
    assert not unfinished, unfinished[:10]
    # and the control plane settles every run the flow had begun: those that ran end as usual (a shard sleeps 20 s),
    # those that waited in the queue are taken out as the flow's process went away
    deadline = time.time() + 120
    while time.time() < deadline and any(h["status"] == "pending" for h in control_plane.ledger().history(t.budget)):
        time.sleep(0.2)
    assert not [h for h in control_plane.ledger().history(t.budget) if h["status"] == "pending"]
