"""The three example flows in flows/, run for real under the test control plane, with the example blocks applied."""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

import pytest

from blocks import AuthorityBlock, Grant
from flows.batch_inference import PRINCIPAL as BATCH_PRINCIPAL
from flows.batch_inference import batch_inference
from flows.common import APPROVER, ensure_example_blocks, example_blocks, example_runner
from flows.llm_pipeline import PRINCIPAL as LLM_PRINCIPAL
from flows.llm_pipeline import llm_pipeline
from flows.training import PRINCIPAL as TRAINING_PRINCIPAL
from flows.training import nightly_training
from tests.controlplane import answer_when_asked

pytestmark = pytest.mark.usefixtures("prefect_api")


@pytest.fixture
def examples(control_plane, tmp_path, monkeypatch):
    """What an operator gives the examples: their blocks applied, and each flow a credential, in the environment."""
    name = f"examples-{uuid.uuid4().hex[:6]}"
    for kind, block in zip(("authority", "budget", "policy", "cluster"), example_blocks()):
        control_plane.apply(kind, name, block)
    monkeypatch.setenv("AISCHED_HOME", str(tmp_path))
    monkeypatch.setenv("AISCHED_CONTROL_PLANE", control_plane.url)

    def act_as(principal: str) -> None:
        monkeypatch.setenv("AISCHED_TOKEN", control_plane.issue(principal, authority=name, budget=name, policy=name,
                                                                cluster=name, tenant="examples"))

    return type("Examples", (), {"name": name, "act_as": staticmethod(act_as), "plane": control_plane,
                                 "approver": control_plane.approver(APPROVER, name)})()


def accounts(examples) -> dict[str, dict]:
    return {a["budget"]: a for a in examples.plane.ledger().accounts() if a["budget"].split("/")[0] == examples.name}


def kinds_of(records, task: str) -> list[str]:
    return [r.kind for r in records if r.payload.get("task") == task]


def test_example_blocks_are_saved_once_and_edits_stick():
    name = f"examples-t-{uuid.uuid4().hex[:6]}"
    assert sorted(ensure_example_blocks(name)) == ["aisched-approval-policy", "aisched-authority", "aisched-budget",
                                                   "aisched-cluster"]
    AuthorityBlock(grants=[Grant(id="edited", principal="x")]).save(name, overwrite=True)  # an operator's edit
    assert ensure_example_blocks(name) == []
    assert [g.id for g in AuthorityBlock.load(name).grants] == ["edited"]


def run_until_approved(examples, flow_fn, principal: str, **parameters):
    """Run a flow in a thread; when it asks for approval, answer as alice on the control plane, as a person would."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(flow_fn(**parameters)))
    thread.start()
    answered = answer_when_asked(examples.plane, examples.approver, principal=principal, reason="eval looks right",
                                 alive=thread.is_alive)
    assert answered is not None, "the flow run never asked for approval"
    thread.join(timeout=120)
    assert not thread.is_alive() and result
    return result[0]


def test_nightly_training_trains_on_two_gpus_evaluates_and_promotes_when_a_person_approves(examples):
    examples.act_as(TRAINING_PRINCIPAL)
    ledger = examples.plane.ledger()
    with_a_person = nightly_training.with_options(task_runner=example_runner(TRAINING_PRINCIPAL, approver="pause"))
    out = run_until_approved(examples, with_a_person, TRAINING_PRINCIPAL, epochs=2)
    train, evaluation = out["train"], out["evaluation"]
    # The trainer subprocess saw exactly the two whole GPUs its task was given.
    seen = train["subprocess_saw"].split(",")
    assert len(set(seen)) == 2 and sorted(seen) == sorted(train["devices"])
    # Evaluation read that checkpoint (on half a GPU) and scored it.
    assert evaluation["checkpoint"] == train["checkpoint"] and evaluation["checkpoint_devices"] == train["subprocess_saw"]
    assert len(evaluation["devices"]) == 1 and evaluation["accuracy"] >= 0.9
    # Promoted: the registry holds the checkpoint, and the ledger shows who approved it under which rule.
    assert out["decision"] == "promoted"
    assert json.loads(Path(out["promoted"]).read_text()) == json.loads(Path(train["checkpoint"]).read_text())
    records = ledger.records(out["flow_run_id"])
    assert kinds_of(records, "train") == kinds_of(records, "evaluate") == ["admission", "settlement"]
    assert kinds_of(records, "promote_to_registry") == ["approval-requested", "approval", "approval-consumed",
                                                        "admission", "settlement"]
    approval = next(r.payload for r in records if r.kind == "approval")
    assert approval["approved"] is True and approval["approver"] == APPROVER and approval["channel"] == "credential"
    asked = next(r.payload for r in records if r.kind == "approval-requested")
    assert asked["approval_rule"] == "promotion-needs-a-person"
    assert ledger.verify().ok


def test_nightly_training_without_a_person_keeps_the_model_unpromoted(examples):
    examples.act_as(TRAINING_PRINCIPAL)
    under_policy = nightly_training.with_options(task_runner=example_runner(TRAINING_PRINCIPAL, approver="policy"))
    out = under_policy(epochs=1, rows=512)
    assert out["promoted"] is None and out["decision"].startswith("not promoted: denied at approval")
    records = examples.plane.records(out["flow_run_id"])
    (denial,) = [r for r in records if r.payload.get("task") == "promote_to_registry"]
    assert denial.kind == "denial" and "approver='policy'" in denial.payload["reason"]  # nothing was held
    assert all(a["pending"] == 0 for a in accounts(examples).values())


def test_batch_inference_gathers_every_shard_from_shared_gpus(examples):
    examples.act_as(BATCH_PRINCIPAL)
    run = batch_inference.with_options(task_runner=example_runner(BATCH_PRINCIPAL))  # built under this environment
    out = run(shards=8, gpu_fraction=0.25, rows_per_shard=100, seconds_per_shard=1.0)
    assert out["shards"] == 8 and out["rows"] == 800
    assert [r["shard"] for r in out["results"]] == list(range(8))
    # Quarter-GPU shards share devices: fewer devices than shards, and several on one device at the same time.
    assert len(out["devices"]) < 8
    assert max(d["most_at_once"] for d in out["devices"].values()) >= 2
    assert sum(len(d["shards"]) for d in out["devices"].values()) == 8
    admissions = [r for r in examples.plane.records(out["flow_run_id"]) if r.kind == "admission"]
    assert len(admissions) == 8 and all(a.payload["request"]["gpus"] == 0.25 for a in admissions)
    # Each holds its share: 0.25 GPU x (1 + 30) s x 4.0 USD per H100-hour.
    assert {round(a.payload["estimate"]["amount"], 6) for a in admissions} == {round(0.25 * 31 * 4.0 / 3600, 6)}


def test_llm_pipeline_charges_reported_tokens_under_the_rate_limit(examples):
    examples.act_as(LLM_PRINCIPAL)
    out = llm_pipeline.with_options(task_runner=example_runner(LLM_PRINCIPAL))()
    usage = out["usage"]
    assert usage["calls"] == 7 and usage["tokens"] == usage["input_tokens"] + usage["output_tokens"] > 0
    settlements = [r.payload for r in examples.plane.records(out["flow_run_id"]) if r.kind == "settlement"]
    assert len(settlements) == 7
    # Each call was charged what it reported, not its 400-token estimate.
    assert sum(s["usage"]["tokens"] for s in settlements) == usage["tokens"]
    tokens = accounts(examples)[f"{examples.name}/llm-tokens"]
    assert tokens["unit"] == "tokens" and tokens["posted"] == usage["tokens"] and tokens["pending"] == 0
    # 120 starts a minute: calls waited for their slot, and the wait is in the evidence.
    waited = [s["model_limit"]["waited"] for s in settlements]
    assert all(s["model_limit"]["limit"] == "example-llm*" for s in settlements)
    assert max(waited) > 0.4


def test_example_blocks_are_consistent():
    """The policy's rules name kinds the authority grants, and the approver may approve promotions."""
    authority, budget, policy, cluster = example_blocks()
    granted = {k for g in authority.grants for k in g.kinds}
    assert {k for r in policy.rules for k in (r.kinds or [])} <= granted
    assert any(g.can_approve and g.held_by(APPROVER, authority.groups) and "promotion" in g.kinds for g in authority.grants)
    assert authority.problems() == []  # an operator can apply it as written
    assert cluster.limit_for("example-llm") is not None and budget.token_price("example-llm") > 0


def test_the_examples_take_their_parameters_from_the_command_line():
    """`python -m flows.batch_inference --shards 300 --gpu-fraction 0.5`: one option per parameter, the flow's
    defaults for the rest; a value of the wrong type is refused naming the option."""
    import doctest

    import flows.common
    from flows.batch_inference import batch_inference
    from flows.common import flow_args
    from flows.training import nightly_training

    assert doctest.testmod(flows.common).failed == 0
    assert flow_args(batch_inference, ["--shards", "300", "--gpu-fraction", "0.5"]) == {"shards": 300,
                                                                                        "gpu_fraction": 0.5}
    assert flow_args(nightly_training, ["--no-promote", "--epochs", "5"]) == {"promote": False, "epochs": 5}
    with pytest.raises(SystemExit):
        flow_args(batch_inference, ["--shards", "many"])
