"""Flows run for real: Prefect test server, a control plane process, Dask worker processes, its SQLite ledger."""

from __future__ import annotations

import re
import time

import pytest
from prefect import flow, task
from prefect.context import FlowRunContext
from prefect.task_runners import ThreadPoolTaskRunner

from aisched_prefect import AdmissionDenied, InvalidAIRequest, ai_task, current_devices, current_worker, evidence_rows
from aisched_prefect.errors import ConfigurationError, NoAdmissionContext
from tests.helpers import authority, budget, tenant

pytestmark = pytest.mark.usefixtures("prefect_api")


def where():
    return current_worker(), [d.index for d in current_devices()], [d.gpu_type for d in current_devices()]


@ai_task(gpus=2, gpu_type="H100", kind="training", est_seconds=20)
def train(cfg):
    time.sleep(0.1)
    return where()


@ai_task(gpus=1, gpu_memory_gb=16, kind="inference", model="demo-embedder", est_seconds=5)
def embed(shard):
    time.sleep(0.1)
    return where()


@ai_task(gpus=1, gpu_type="A10", kind="inference", est_seconds=5)
def on_a10():
    return where()


@task
def plain(x):
    return x + 1


def denial_of(ai, *args):
    """Call an AI task in a flow and return (stage, message) of its denial."""
    try:
        ai(*args)
    except AdmissionDenied as exc:
        return exc.stage, str(exc)
    raise AssertionError(f"{ai.name} was admitted")


def kinds_by_task(records):
    out: dict[str, list[str]] = {}
    for r in records:
        out.setdefault(r.task_run_id, []).append(r.kind)
    return out


def accounts_of(plane, t):
    return [a for a in plane.ledger().accounts() if a["budget"].split("/")[0].split("#")[0] == t.budget]


def test_nightly_places_on_gpus_and_leaves_evidence(control_plane):
    t = tenant(control_plane)

    @flow(task_runner=t.runner())
    def nightly():
        n = plain(1)
        tr = train({"lr": 1})
        futures = embed.map(range(n + 1))
        a10 = on_a10.submit()
        return tr, [f.result() for f in futures], a10.result(), FlowRunContext.get().flow_run.id

    (t_worker, t_devices, t_types), embeds, a10, flow_run_id = nightly()
    assert t_types == ["H100", "H100"] and sorted(t_devices) == [0, 1]
    assert len(embeds) == 3 and all(len(d) == 1 for _, d, _ in embeds)
    assert a10[2] == ["A10"]
    ledger = control_plane.ledger()
    records = control_plane.records(flow_run_id)
    assert ledger.verify().ok
    # One admission and one settlement per AI task run: direct call, .map() and .submit() alike; the map's later
    # shards hold their budget as the queue starts them (one `shard-hold` each, naming its admission).
    kinds = sorted(kinds_by_task(records).values())
    assert kinds == [["admission", "settlement"]] * 3 + [["admission", "shard-hold", "settlement"]] * 2, kinds
    rows = evidence_rows(records)
    train_row = next(r for r in rows if r["task"] == "train")
    assert train_row["address"] == t_worker and train_row["grant"] == "team-a-root"
    assert 0 < train_row["charged"] <= train_row["reserved"]
    (account,) = accounts_of(control_plane, t)
    assert account["pending"] == 0 and account["posted"] == pytest.approx(sum(r["charged"] for r in rows), abs=1e-5)


def test_evidence_artifact_is_attached_to_the_flow_run(control_plane):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    @flow(task_runner=tenant(control_plane).runner())
    def one():
        embed(0)
        return FlowRunContext.get().flow_run.id

    flow_run_id = one()
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    evidence = next(a for a in artifacts if a.key == "aisched-evidence")
    (row,) = evidence.data if isinstance(evidence.data, list) else __import__("json").loads(evidence.data)
    assert row["task"] == "embed" and row["decision"] == "completed" and row["devices"] is not None


def _scheduler_keys(client) -> set[str]:
    return set(client.run_on_scheduler(lambda dask_scheduler: [str(t[0]) for t in dask_scheduler.transition_log]))


def test_principal_without_grant_is_denied_and_never_reaches_dask(control_plane, dask_client):
    t = tenant(control_plane, principal="team-b/intruder")

    @flow(task_runner=t.runner())
    def intruder():
        return denial_of(embed, 0), FlowRunContext.get().flow_run.id

    (stage, message), flow_run_id = intruder()
    assert stage == "authority"
    assert "principal 'team-b/intruder' holds no grant" in message and "Fix: an operator grants" in message
    (denial,) = control_plane.records(flow_run_id)
    assert denial.kind == "denial" and denial.payload["stage"] == "authority"
    assert not any(denial.task_run_id in k for k in _scheduler_keys(dask_client))
    assert accounts_of(control_plane, t) == []  # nothing was held


@pytest.mark.parametrize(
    "grant, match",
    [({"kinds": ["inference"]}, "allows kinds"), ({"max_gpus": 1}, "max_gpus=1"),
     ({"gpu_types": ["A10"]}, "allows GPU types"), ({"max_cost_per_run": 0.01}, "max_cost_per_run"),
     ({"models": ["llama-8b"]}, "declares none: set model=")],
)
def test_grant_dimensions_deny(control_plane, grant, match):
    @flow(task_runner=tenant(control_plane, authority_=authority(**grant)).runner())
    def f():
        return denial_of(train, {})

    stage, message = f()
    assert stage == "authority" and match in message


def test_hold_that_would_pass_the_budget_is_denied(control_plane):
    # embed holds 1 GPU x 5 s x 4.0/h = 0.0056 and fits; train holds 2 x 20 s x 4.0/h = 0.0444 and does not.
    t = tenant(control_plane, budget_=budget(limit=0.03))

    @flow(task_runner=t.runner())
    def f():
        embed(0)
        return denial_of(train, {}), FlowRunContext.get().flow_run.id

    (stage, message), flow_run_id = f()
    assert stage == "budget" and "left of 0.03" in message and "needs 0.0444" in message
    (account,) = accounts_of(control_plane, t)
    assert account["pending"] == 0 and account["posted"] + account["pending"] <= account["limit"]
    assert [r.kind for r in control_plane.records(flow_run_id)] == ["admission", "settlement", "denial"]


def test_infeasible_request_fails_fast_naming_the_largest_worker(control_plane):
    @ai_task(gpus=8, kind="training", est_seconds=60)
    def huge():
        return 1

    @flow(task_runner=tenant(control_plane, authority_=authority(max_gpus=8)).runner())
    def f():
        return denial_of(huge)

    t0 = time.perf_counter()
    stage, message = f()
    assert time.perf_counter() - t0 < 20
    assert stage == "feasibility"
    assert re.search(r"gpus=8.*largest worker gpu-worker-\d has 2 x H100 80 GB", message)


def test_task_failure_is_settled_and_recorded(control_plane):
    @ai_task(gpus=1, kind="inference", est_seconds=5)
    def broken():
        raise ValueError("model exploded")

    t = tenant(control_plane)
    ids = []

    @flow(task_runner=t.runner())
    def f():
        ids.append(FlowRunContext.get().flow_run.id)
        return broken()

    with pytest.raises(ValueError, match="model exploded"):
        f()
    settlement = control_plane.records(ids[0])[-1]
    assert settlement.kind == "settlement" and settlement.payload["outcome"] == "failed"
    assert "model exploded" in settlement.payload["error"]
    assert accounts_of(control_plane, t)[0]["pending"] == 0


def test_ai_task_outside_the_runner_is_refused():
    @flow(task_runner=ThreadPoolTaskRunner())
    def f():
        return embed(0)

    with pytest.raises(NoAdmissionContext, match="AISchedTaskRunner"):
        f()


def test_with_options_copy_still_passes_admission(control_plane):
    renamed = embed.with_options(name="embed-renamed", retries=2)

    @flow(task_runner=tenant(control_plane, principal="nobody/x").runner())
    def f():
        return denial_of(renamed, 0), FlowRunContext.get().flow_run.id

    (_, message), flow_run_id = f()
    assert "holds no grant" in message
    assert [r.kind for r in control_plane.records(flow_run_id)] == ["denial"]  # denials are not retried


@pytest.mark.parametrize(
    "kwargs, field",
    [({"gpus": -1}, "gpus"), ({"gpus": 1}, "est_seconds"), ({"kind": "Training!"}, "kind"),
     ({"gpu_type": "H100"}, "gpu_memory_gb/gpu_type need gpus")],
)
def test_invalid_request_names_the_field(kwargs, field):
    with pytest.raises(InvalidAIRequest, match=field):
        ai_task(**{"kind": "inference", **kwargs})(lambda: None)


def test_runner_configuration_errors_name_the_field():
    from aisched_prefect import AISchedTaskRunner

    with pytest.raises(ConfigurationError, match="principal"):
        AISchedTaskRunner(principal="team-a/*", authority="a", budget="b")
    with pytest.raises(ConfigurationError, match="approver"):
        AISchedTaskRunner(principal="p", authority="a", budget="b", approver="slack")
    with pytest.raises(ConfigurationError, match="ledger_url=...\\) is refused: the ledger belongs to the control plane"):
        AISchedTaskRunner(principal="p", authority="a", budget="b", ledger_url="sqlite:///mine.db")
    with pytest.raises(ConfigurationError, match="address=...\\) is refused"):
        AISchedTaskRunner(principal="p", authority="a", budget="b", address="tcp://127.0.0.1:8786")
    with pytest.raises(ConfigurationError, match="authority: .*not a AuthorityBlock object"):
        AISchedTaskRunner(principal="p", authority=authority(), budget="b")


def test_the_runner_may_only_repeat_what_its_credential_proves(control_plane):
    t = tenant(control_plane)

    @flow(task_runner=t.runner(principal="team-z/other"))
    def claims_another_principal():
        return embed(0)

    with pytest.raises(ConfigurationError, match="the credential proves principal='team-a/nightly'"):
        claims_another_principal()

    @flow(task_runner=t.runner(principal="team-a/nightly", authority=t.authority))
    def repeats_it():
        return embed(0)

    assert repeats_it()


def test_runner_pickles_and_duplicates_with_every_argument():
    """Prefect duplicates the runner per flow run and may pickle the flow: no live state may ride along."""
    import cloudpickle

    from aisched_prefect import AISchedTaskRunner

    original = AISchedTaskRunner(principal="team-a/x", authority="team-a", budget="team-a", approval_policy="p",
                                 approver="policy", declared="2 GPUs", max_workers=7, control_plane="http://cp:1",
                                 queue=True)
    copy = cloudpickle.loads(cloudpickle.dumps(original.duplicate()))
    assert copy == original and copy.config == original.config
    assert copy._max_workers == 7
    with pytest.raises(NoAdmissionContext, match="not started"):
        copy.session


def test_fractional_ai_tasks_share_gpus_and_pay_their_share(control_plane):
    @ai_task(gpus=0.5, gpu_memory_gb=30, gpu_type=["H100", "A100"], kind="inference", est_seconds=36)
    def half(i):
        time.sleep(0.2)
        return where()

    @flow(task_runner=tenant(control_plane).runner())
    def f():
        return [x.result() for x in half.map(range(6))], FlowRunContext.get().flow_run.id

    runs, flow_run_id = f()
    assert all(types == ["H100"] and len(devices) == 1 for _, devices, types in runs)
    admissions = [r for r in control_plane.records(flow_run_id) if r.kind == "admission"]
    # 0.5 GPU x 36 s x 4.0/GPU-hour = 0.02 held per run.
    assert [round(a.payload["estimate"]["amount"], 6) for a in admissions] == [0.02] * 6


def test_logs_from_the_task_body_reach_its_prefect_task_run(control_plane):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId

    from aisched_prefect import task_logger

    @ai_task(gpus=1, kind="inference", est_seconds=5)
    def chatty():
        from prefect.context import TaskRunContext

        # WARNING: the tests run Prefect at PREFECT_LOGGING_LEVEL=WARNING, and the replay respects it.
        task_logger().warning("working on device %s", current_devices()[0].key)
        return TaskRunContext.get()  # None: the body runs in its own process on the worker, outside the context

    @flow(task_runner=tenant(control_plane).runner())
    def f():
        state = chatty(return_state=True)
        return state.state_details.task_run_id, state.result()

    task_run_id, context_on_worker = f()
    assert context_on_worker is None
    deadline = time.time() + 30
    messages: list[str] = []
    while time.time() < deadline and not any("working on device" in m for m in messages):
        with get_client(sync_client=True) as client:
            logs = client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id])))
        messages = [log.message for log in logs]
        time.sleep(0.5)
    assert any(m.startswith("working on device ") for m in messages), messages


def test_a_requests_priority_is_capped_by_its_grant(control_plane):
    @ai_task(gpus=1, kind="inference", est_seconds=5, priority=50)
    def urgent():
        return "ok"

    @flow(task_runner=tenant(control_plane, authority_=authority(max_priority=5)).runner())
    def asks_for_more():
        return urgent(), FlowRunContext.get().flow_run.id

    out, flow_run_id = asks_for_more()
    assert out == "ok"
    (admission,) = [r for r in control_plane.records(flow_run_id) if r.kind == "admission"]
    assert admission.payload["request"]["priority"] == 50 and admission.payload["priority"] == 5


def test_a_call_can_say_what_it_asks_for_and_still_passes_admission(control_plane):
    """A flow that takes `gpus` as a parameter says it at the call: train.with_options(gpus=1)."""
    from aisched_prefect import request_of

    one_gpu = train.with_options(gpus=1, est_seconds=10)
    assert request_of(one_gpu).gpus == 1 and request_of(train).gpus == 2  # the decorated task is unchanged

    @flow(task_runner=tenant(control_plane, authority_=authority(max_gpus=1)).runner())
    def f():
        return one_gpu({"lr": 1}), denial_of(train, {}), FlowRunContext.get().flow_run.id

    (_, devices, _), (stage, message), flow_run_id = f()
    assert len(devices) == 1 and stage == "authority" and "max_gpus=1" in message
    (admission,) = [r for r in control_plane.records(flow_run_id) if r.kind == "admission"]
    assert admission.payload["request"]["gpus"] == 1 and admission.payload["request"]["est_seconds"] == 10


def test_a_missing_block_fails_the_flow_run_with_one_clear_line():
    """An embedded control plane's block that does not exist: the run ends Failed (not Running), saying which and how."""
    import logging

    from prefect.client.orchestration import get_client

    from aisched_prefect import AISchedTaskRunner

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.DEBUG)
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logging.getLogger(name).addHandler(handler)
    try:
        @flow(task_runner=AISchedTaskRunner(principal="team-a/x", authority="team-a-typo", budget="team-a-typo"))
        def typo():
            return embed(0)

        state = typo(return_state=True)
    finally:
        for name in ("prefect.task_runs", "prefect.flow_runs"):
            logging.getLogger(name).removeHandler(handler)
    assert state.is_failed() and "authority block 'team-a-typo' could not be loaded" in state.message
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(state.state_details.flow_run_id).state.is_failed()
    about = [r for r in records if "team-a-typo" in r.getMessage()]
    assert about and all(r.levelno == logging.WARNING and r.exc_info is None for r in about), \
        [(r.levelname, r.getMessage()[:80]) for r in about]
