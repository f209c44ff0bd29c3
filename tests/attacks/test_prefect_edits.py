"""Attack 3, editing its own configuration through Prefect's API, and attack 9's check: a flow cannot approve itself.

Prefect OSS's API has no authentication, so anything the flow process runs can rewrite blocks and resume its own
paused run. Before: a flow widened its AuthorityBlock, ran, and restored it; saved its own key for "alice" and
signed approvals as alice (`verified: true`); answered its own pause as a keyless approver. Now a block is only the
editing surface: the control plane acts on what an operator applied, approver keys come from the applied
authority, and an answer counts only from an approver credential or a key the control plane knows.
"""

from __future__ import annotations

import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from aisched_prefect.approvals import public_key_hex, sign_approval
from blocks import ApprovalPolicyBlock, ApprovalRule, AuthorityBlock, BudgetBlock
from tests.attacks.support import PRINCIPAL, FlowThread, authority, budget, kinds, outcome, root, run_flow, train, wait_for

pytestmark = pytest.mark.usefixtures("prefect_api")


def configs(plane) -> dict:
    return {(c["kind"], c["name"]): (c["version"], c["digest"]) for c in plane.ok("GET", "/v1/config")}


def test_a_flow_rewriting_its_blocks_in_prefect_gains_nothing_until_an_operator_applies(control_plane):
    """The operator saved the blocks in Prefect and applied them; the flow then widens them through Prefect's API
    (more GPUs, a root of its own, an unlimited budget, an approver key of its own) and runs."""
    narrow = authority(root(max_gpus=1))
    t = control_plane.tenant(narrow, budget(limit=0.01), principal=PRINCIPAL)
    narrow.save(t.authority, overwrite=True)
    budget(limit=0.01).save(t.budget, overwrite=True)
    applied = configs(control_plane)

    def widen_then_run():
        block = AuthorityBlock.load(t.authority)
        AuthorityBlock(grants=[g.model_copy(update={"max_gpus": 8, "max_cost_per_run": 1e6}) for g in block.grants]
                       + [root(max_gpus=8, max_cost_per_run=1e6)],
                       approver_keys={"alice": public_key_hex(Ed25519PrivateKey.generate())}
                       ).save(t.authority, overwrite=True)
        BudgetBlock(limit=1e9, gpu_hour_prices={"H100": 0.0}).save(t.budget, overwrite=True)
        return outcome(train)

    out, flow_run_id = run_flow(t.runner(), widen_then_run)
    assert out.startswith("denied: denied at authority") and "max_gpus=1, not gpus=2" in out
    assert kinds(control_plane.records(flow_run_id)) == ["denial"]
    assert AuthorityBlock.load(t.authority).grants[0].max_gpus == 8  # the edit is there, in Prefect...
    assert configs(control_plane) == applied  # ...and the control plane still enforces what was applied


def test_a_flow_cannot_approve_its_own_run_by_any_means_it_has(control_plane):
    """The run waits for a person. The flow process then (1) rewrites its approval policy in Prefect to ask nobody,
    (2) answers with its own credential, (3) saves a key of its own for 'alice' in its AuthorityBlock and signs as
    alice, (4) resumes its own Prefect pause with approve=True. None counts; bob's rejection ends it."""
    from prefect.client.orchestration import get_client
    from prefect.flow_runs import resume_flow_run

    approvers = [root(p, kinds=["training"], max_gpus=8, max_cost_per_run=100, can_approve=True) for p in ("alice", "bob")]
    policy = ApprovalPolicyBlock(rules=[ApprovalRule(name="training-needs-a-person", kinds=["training"])],
                                 timeout_seconds=90)
    blocks = authority(root(), *approvers)
    t = control_plane.tenant(blocks, budget(), policy, principal=PRINCIPAL)
    blocks.save(t.authority, overwrite=True)
    ApprovalPolicyBlock(rules=[]).save(t.policy, overwrite=True)  # (1), before the call: still asked
    bob = control_plane.approver("bob", t.authority)

    run = FlowThread(t.runner(), lambda: outcome(train))

    def pending():
        assert run.thread.is_alive(), f"the flow run ended without asking: {run.result or run.error}"
        return next((v for v in control_plane.ok("GET", "/v1/approvals") if v["principal"] == t.principal
                     and v["chain"] and v["chain"][0] == blocks.grants[0].id), None)

    view = wait_for(pending, 60, "the run's approval request")
    answer = f"/v1/approvals/{view['id']}/answer"

    # (2) the flow's own credential
    resp = control_plane.request("POST", answer, token=t.token, json={"approve": True, "approver": "alice"})
    assert resp.status_code == 403 and "a flow's credential cannot approve" in resp.text

    # (3) a key of its own, saved for alice in the block it can edit
    key = Ed25519PrivateKey.generate()
    AuthorityBlock(grants=blocks.grants, approver_keys={"alice": public_key_hex(key)}).save(t.authority, overwrite=True)
    signed_at = time.time()
    signature = sign_approval(key, view["digest"], True, "alice", "lgtm", signed_at)
    for token in (t.token, ""):
        resp = control_plane.request("POST", answer, token=token, json={
            "approve": True, "approver": "alice", "reason": "lgtm", "signature": signature, "signed_at": signed_at})
        assert resp.status_code == 403 and "has no key in the applied authority's approver_keys" in resp.text

    # (4) its own Prefect pause, answered through Prefect's API
    flow_run_id = view["flow_run_id"]
    with get_client(sync_client=True) as prefect:
        def paused():
            state = prefect.read_flow_run(flow_run_id).state
            return state if state is not None and state.is_paused() else None

        first = wait_for(paused, 60, "the flow run to pause")

        def resumed_by_the_flow():
            try:
                resume_flow_run(flow_run_id, run_input={"approve": True, "approver": "alice", "reason": "me"})
                return True
            except Exception:  # the form's schema is saved just after the pause
                return False

        wait_for(resumed_by_the_flow, 30, "the pause to accept an answer", interval=0.2)
        wait_for(lambda: (s := paused()) is not None and s.state_details.pause_key != first.state_details.pause_key,
                 60, "the flow run to pause again")
    assert control_plane.ok("GET", f"/v1/approvals/{view['id']}")["status"] == "pending"

    resp = control_plane.request("POST", answer, token=bob, json={"approve": False, "approver": "bob", "reason": "no"})
    assert resp.status_code == 200, resp.text
    out, _ = run.join()
    assert out.startswith("denied: denied at approval: bob rejected the run"), out
    records = control_plane.records(flow_run_id)
    assert kinds(records) == ["approval-requested", "approval-unverified", "approval", "settlement"]
    decided = records[2].payload
    assert decided["approver"] == "bob" and decided["approved"] is False and decided["channel"] == "credential"
