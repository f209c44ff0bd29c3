"""Self-granted authority: a flow (or an approver) tries every operator act with the one credential it holds, and
a flow tries to be its own approver by configuration.

Also the code identity an approval rule keys on: `new_flow_version` asks a person for code that never ran before;
the digest that decides it must change whenever what will run changes.
"""

from __future__ import annotations

import pytest

from blocks import ApprovalPolicyBlock, ApprovalRule
from dask_gpu.body.code import code_digest
from tests.attacks.support import PRINCIPAL, authority, budget, infer, kinds, outcome, root, run_flow, tenant, uid

pytestmark = pytest.mark.usefixtures("prefect_api")


def test_a_flow_or_approver_credential_cannot_do_an_operators_acts(control_plane):
    grant = root(can_delegate=True)
    t = tenant(control_plane, grant)
    approver = control_plane.approver("alice", t.authority)
    me = control_plane.ok("GET", "/v1/whoami", token=t.token)
    widened = authority(root(max_gpus=64, max_cost_per_run=1e9))
    from aisched_prefect.control.authority.state import block_body

    for token in (t.token, approver):
        acts = [
            ("POST", f"/v1/config/authority/{t.authority}", {"json": block_body(widened)}),
            ("POST", "/v1/config/budget/" + t.budget, {"json": block_body(budget(limit=1e9))}),
            ("POST", "/v1/credentials", {"json": {"principal": "team-a/root", "role": "operator"}}),
            ("POST", "/v1/credentials", {"json": {"principal": PRINCIPAL, "role": "approver", "authority": t.authority}}),
            ("POST", f"/v1/credentials/{me['id']}/revoke", {}),
            ("GET", "/v1/config", {}),
            ("GET", "/v1/cluster", {}),
        ]
        for method, path, kw in acts:
            resp = control_plane.request(method, path, token=token, **kw)
            assert resp.status_code == 403, (method, path, resp.status_code, resp.text)
    assert control_plane.request("GET", "/v1/approvals", token=t.token).status_code == 403
    # Delegating to itself is no way up: a child of its own grant is never wider than it.
    wider = control_plane.delegate(grant.id, t.token, id=uid("self"), principal=PRINCIPAL, max_gpus=64)
    assert wider.status_code == 403 and wider.json()["field"] == "max_gpus"
    # An approver's credential runs nothing.
    from aisched_prefect.wire import CallMeta, frame

    meta = CallMeta(task_name="infer", task_run_id="tr-a", flow_run_id="fr-a", run_key="fr-a/k",
                    request={"kind": "inference", "gpus": 1, "est_seconds": 5}, code_digest="0" * 64, args_offset=1)
    resp = control_plane.http.post("/v1/calls", content=frame(meta.model_dump_json().encode(), b"xx"),
                                   headers={"authorization": f"Bearer {approver}",
                                            "content-type": "application/x-aisched-frame"})
    assert resp.status_code == 403 and "may not do this (needs flow)" in resp.text
    assert control_plane.ok("GET", "/v1/whoami", token=t.token)["revoked"] is False


def test_a_flow_that_says_nobody_need_be_asked_is_denied_where_the_policy_asks(control_plane):
    """approver='policy' is what a flow may choose; it never turns 'ask a person' into 'approved'."""
    policy = ApprovalPolicyBlock(rules=[ApprovalRule(name="inference-needs-a-person", kinds=["inference"])],
                                 timeout_seconds=30)
    t = control_plane.tenant(authority(root()), budget(), policy, principal=PRINCIPAL)
    out, flow_run_id = run_flow(t.runner(approver="policy"), lambda: outcome(infer, 1))
    assert out.startswith("denied: denied at approval") and "inference-needs-a-person" in out
    assert kinds(control_plane.records(flow_run_id)) == ["denial"]


def _versions():
    """Two versions of one task body, as two deployments of a flow's code would define it: same name, same
    bytecode; what changed is a default argument, a value it closes over, and the helper it calls."""

    def make(steps_default: int, scale: float, helper):
        def train(data, steps=steps_default):
            return helper([x * scale for x in data])[:steps]

        return train

    v1 = make(10, 1.0, lambda xs: sorted(xs))
    v2 = make(10**9, -1.0, lambda xs: [__import__("os").getpid()] * len(xs))
    return v1, v2


def test_a_changed_body_is_a_new_code_version():
    v1, v2 = _versions()
    assert v1([3, 1, 2]) != v2([3, 1, 2])  # they do different things
    assert code_digest(v1) != code_digest(v2)


def _module_versions():
    """One body as two deployments of its module would define it: the same source, reading a module constant and
    a class of its module, whose values changed between the deployments."""
    import types

    source = "def train(data):\n    return Model(STEPS).fit(data)\n"

    class ModelV1:
        def __init__(self, steps):
            self.steps = steps

        def fit(self, data):
            return sorted(data)[: self.steps]

    class ModelV2(ModelV1):
        def fit(self, data):
            return [__import__("os").getpid()] * self.steps

    out = []
    for steps, model in ((10, ModelV1), (10**6, ModelV2)):
        namespace = {"__name__": "flows.nightly", "STEPS": steps, "Model": model}
        exec(compile(source, "flows/nightly.py", "exec"), namespace)
        fn = namespace["train"]
        assert isinstance(fn, types.FunctionType)
        out.append(fn)
    return out


def test_a_changed_module_constant_or_class_is_a_new_code_version():
    v1, v2 = _module_versions()
    assert v1([3, 1, 2]) != v2([3, 1, 2])
    assert code_digest(v1) != code_digest(v2)
