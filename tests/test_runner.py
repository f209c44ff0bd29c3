"""Flows run for real: Prefect test server, Dask worker processes, SQLite ledger."""

from __future__ import annotations

import re
import time

import pytest
from prefect import flow, task
from prefect.task_runners import ThreadPoolTaskRunner

from aisched_prefect import AdmissionDenied, InvalidAIRequest, Ledger, ai_task, current_devices, evidence_rows
from aisched_prefect.errors import ConfigurationError, NoAdmissionContext
from tests.helpers import authority, budget, runner

pytestmark = pytest.mark.usefixtures("prefect_api")


def where():
    from distributed import get_worker

    return get_worker().address, [d.index for d in current_devices()], [d.gpu_type for d in current_devices()]


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


def test_nightly_places_on_gpus_and_leaves_evidence(gpu_cluster, sqlite_url):
    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url))
    def nightly():
        n = plain(1)
        t = train({"lr": 1})
        futures = embed.map(range(n + 1))
        a10 = on_a10.submit()
        return t, [f.result() for f in futures], a10.result()

    (t_worker, t_devices, t_types), embeds, a10 = nightly()
    assert t_types == ["H100", "H100"] and sorted(t_devices) == [0, 1]
    assert len(embeds) == 3 and all(len(d) == 1 for _, d, _ in embeds)
    assert a10[2] == ["A10"]
    ledger = Ledger(sqlite_url)
    records = ledger.records()
    assert ledger.verify().ok
    # One admission and one settlement per AI task run: direct call, .map() and .submit() alike.
    assert sorted(kinds_by_task(records).values()) == [["admission", "settlement"]] * 5
    rows = evidence_rows(records)
    train_row = next(r for r in rows if r["task"] == "train")
    assert train_row["worker"] == t_worker and train_row["grant"] == "team-a-root"
    assert 0 < train_row["charged"] <= train_row["reserved"]
    account = ledger.accounts()[0]
    assert account["pending"] == 0 and account["posted"] == pytest.approx(sum(r["charged"] for r in rows), abs=1e-5)


def test_evidence_artifact_is_attached_to_the_flow_run(gpu_cluster, sqlite_url):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.context import FlowRunContext

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url))
    def one():
        embed(0)
        return FlowRunContext.get().flow_run.id

    flow_run_id = one()
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    keys = {a.key for a in artifacts}  # the evidence table, and the usage reports of the run and of the day
    day = {k for k in keys if k.startswith("aisched-usage-20")}
    assert keys - day == {"aisched-evidence", f"aisched-usage-{str(flow_run_id)[:8]}"} and len(day) == 1, keys
    evidence = next(a for a in artifacts if a.key == "aisched-evidence")
    (row,) = evidence.data if isinstance(evidence.data, list) else __import__("json").loads(evidence.data)
    assert row["task"] == "embed" and row["decision"] == "completed" and row["devices"] is not None


def _scheduler_keys(client) -> set[str]:
    return set(client.run_on_scheduler(lambda dask_scheduler: [str(t[0]) for t in dask_scheduler.transition_log]))


def test_principal_without_grant_is_denied_and_never_reaches_dask(gpu_cluster, dask_client, sqlite_url):
    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, principal="team-b/intruder"))
    def intruder():
        return denial_of(embed, 0)

    stage, message = intruder()
    assert stage == "authority"
    assert "principal 'team-b/intruder' holds no grant" in message and "Fix: add or widen a grant" in message
    (denial,) = Ledger(sqlite_url).records()
    assert denial.kind == "denial" and denial.payload["stage"] == "authority"
    assert not any(denial.task_run_id in k for k in _scheduler_keys(dask_client))
    assert Ledger(sqlite_url).accounts() == []  # nothing was held


@pytest.mark.parametrize(
    "grant, match",
    [({"kinds": ["inference"]}, "allows kinds"), ({"max_gpus": 1}, "max_gpus=1"),
     ({"gpu_types": ["A10"]}, "allows GPU types"), ({"max_cost_per_run": 0.01}, "max_cost_per_run")],
)
def test_grant_dimensions_deny(gpu_cluster, sqlite_url, grant, match):
    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority=authority(**grant)))
    def f():
        return denial_of(train, {})

    stage, message = f()
    assert stage == "authority" and match in message


def test_hold_that_would_pass_the_budget_is_denied(gpu_cluster, sqlite_url):
    # embed holds 1 GPU x 5 s x 4.0/h = 0.0056 and fits; train holds 2 x 20 s x 4.0/h = 0.0444 and does not.
    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, budget=budget(limit=0.03)))
    def f():
        embed(0)
        return denial_of(train, {})

    stage, message = f()
    assert stage == "budget" and "left of 0.03" in message and "needs 0.0444" in message
    ledger = Ledger(sqlite_url)
    account = ledger.accounts()[0]
    assert account["pending"] == 0 and account["posted"] + account["pending"] <= account["limit"]
    assert [r.kind for r in ledger.records()] == ["admission", "settlement", "denial"]


def test_infeasible_request_fails_fast_naming_the_largest_worker(gpu_cluster, sqlite_url):
    @ai_task(gpus=8, kind="training", est_seconds=60)
    def huge():
        return 1

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority=authority(max_gpus=8)))
    def f():
        return denial_of(huge)

    t0 = time.perf_counter()
    stage, message = f()
    assert time.perf_counter() - t0 < 20
    assert stage == "feasibility"
    assert re.search(r"gpus=8.*largest worker gpu-worker-\d has 2 x H100 80 GB", message)


def test_task_failure_is_settled_and_recorded(gpu_cluster, sqlite_url):
    @ai_task(gpus=1, kind="inference", est_seconds=5)
    def broken():
        raise ValueError("model exploded")

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url))
    def f():
        return broken()

    with pytest.raises(ValueError, match="model exploded"):
        f()
    ledger = Ledger(sqlite_url)
    settlement = ledger.records()[-1]
    assert settlement.kind == "settlement" and settlement.payload["outcome"] == "failed"
    assert "model exploded" in settlement.payload["error"]
    assert ledger.accounts()[0]["pending"] == 0


def test_ai_task_outside_the_runner_is_refused(sqlite_url):
    @flow(task_runner=ThreadPoolTaskRunner())
    def f():
        return embed(0)

    with pytest.raises(NoAdmissionContext, match="AISchedTaskRunner"):
        f()


def test_with_options_copy_still_passes_admission(gpu_cluster, sqlite_url):
    renamed = embed.with_options(name="embed-renamed", retries=2)

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, principal="nobody/x"))
    def f():
        return denial_of(renamed, 0)

    assert "holds no grant" in f()[1]
    assert [r.kind for r in Ledger(sqlite_url).records()] == ["denial"]  # denials are not retried


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
    with pytest.raises(ConfigurationError, match="top_up_fraction: Input should be greater than 0"):
        AISchedTaskRunner(principal="p", authority="a", budget="b", top_up_fraction=0)
    with pytest.raises(ConfigurationError, match="hold_lease_seconds: Input should be greater than or equal to 1"):
        AISchedTaskRunner(principal="p", authority="a", budget="b", hold_lease_seconds=0.1)


def test_blocks_are_loaded_by_name(gpu_cluster, sqlite_url):
    authority().save("test-team", overwrite=True)
    budget().save("test-team", overwrite=True)

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority="test-team", budget="test-team"))
    def f():
        return embed(0)

    assert f()
    (admission, _) = Ledger(sqlite_url).records()
    assert admission.payload["authority"] == "test-team" and admission.payload["budget"] == "test-team"


def test_missing_block_is_a_clear_error(gpu_cluster, sqlite_url):
    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority="no-such-block"))
    def f():
        return 1

    with pytest.raises(AdmissionDenied, match=r"authority block 'no-such-block' could not be loaded.*AuthorityBlock"):
        f()


def test_embedded_cluster_starts_and_stops(sqlite_url):
    @flow(task_runner=runner(None, sqlite_url, declared="1 worker x 1 GPU, 24 GB, A10"))
    def f():
        return on_a10()

    _, devices, types = f()
    assert devices == [0] and types == ["A10"]


def test_runner_pickles_and_duplicates_with_every_argument():
    """Prefect duplicates the runner per flow run and may pickle the flow: no live state may ride along."""
    import cloudpickle

    from aisched_prefect import AISchedTaskRunner

    original = AISchedTaskRunner(principal="team-a/x", authority=authority(), budget="team-a", approval_policy="p",
                                 approver="policy", address="tcp://127.0.0.1:1", declared="2 GPUs", ledger_url="sqlite://",
                                 max_workers=7, ticket_ttl_seconds=60)
    copy = cloudpickle.loads(cloudpickle.dumps(original.duplicate()))
    assert copy == original and copy.config == original.config
    assert copy._max_workers == 7
    with pytest.raises(NoAdmissionContext, match="not started"):
        copy.session


def test_fractional_ai_tasks_share_gpus_and_pay_their_share(gpu_cluster, sqlite_url):
    @ai_task(gpus=0.5, gpu_memory_gb=30, gpu_type=["H100", "A100"], kind="inference", est_seconds=36)
    def half(i):
        time.sleep(0.2)
        return where()

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url))
    def f():
        return [x.result() for x in half.map(range(6))]

    runs = f()
    assert all(types == ["H100"] and len(devices) == 1 for _, devices, types in runs)
    admissions = [r for r in Ledger(sqlite_url).records() if r.kind == "admission"]
    # 0.5 GPU x 36 s x 4.0/GPU-hour = 0.02 held per run.
    assert [round(a.payload["estimate"]["amount"], 6) for a in admissions] == [0.02] * 6


def test_logs_from_the_task_body_reach_its_prefect_task_run(gpu_cluster, sqlite_url):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId

    from aisched_prefect import task_logger

    @ai_task(gpus=1, kind="inference", est_seconds=5)
    def chatty():
        from prefect.context import TaskRunContext

        # WARNING: the tests run Prefect at PREFECT_LOGGING_LEVEL=WARNING, and the replay respects it.
        task_logger().warning("working on device %s", current_devices()[0].key)
        return TaskRunContext.get()  # None: the body runs on the worker, outside the task-run context

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url))
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


def test_a_requests_priority_is_capped_by_its_grant(gpu_cluster, sqlite_url):
    @ai_task(gpus=1, kind="inference", est_seconds=5, priority=50)
    def urgent():
        return "ok"

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority=authority(max_priority=5)))
    def asks_for_more():
        return urgent()

    assert asks_for_more() == "ok"
    (admission,) = [r for r in Ledger(sqlite_url).records() if r.kind == "admission"]
    assert admission.payload["request"]["priority"] == 50 and admission.payload["priority"] == 5
