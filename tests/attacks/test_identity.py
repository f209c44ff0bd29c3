"""Attack 2, its own identity: the principal is what the credential proves, whatever the flow process says or edits.

Before: the principal was a string the flow passed, and rewriting `session.config.principal` at run time admitted
the run under another principal. Now the control plane reads who calls from the Bearer token alone.
"""

from __future__ import annotations

import json

import pytest
from prefect.context import FlowRunContext

from aisched_prefect import ConfigurationError
from aisched_prefect.wire import CallMeta, frame
from tests.attacks.support import PRINCIPAL, flow_credential, infer, outcome, root, run_flow, tenant

pytestmark = pytest.mark.usefixtures("prefect_api")


@pytest.mark.parametrize("claim", [{"principal": "team-a/admin"}, {"tenant": "team-z"}, {"authority": "someone-elses"},
                                   {"budget": "someone-elses"}])
def test_a_runner_naming_another_identity_than_its_credential_is_refused(control_plane, claim):
    t = tenant(control_plane)
    with pytest.raises(ConfigurationError, match="the control plane decides who a flow is"):
        run_flow(t.runner(**claim), lambda: infer(0))


def test_rewriting_the_sessions_identity_at_run_time_changes_nothing(control_plane):
    """The flow's credential is for team-a/nightly, which holds nothing; team-a/admin holds a root. Mid-run the flow
    rewrites everything the flow process knows about who it is, then calls under admin's grant."""
    admins = root("team-a/admin", max_gpus=8, max_cost_per_run=100)
    t = tenant(control_plane, admins, principal=PRINCIPAL)

    def impersonate():
        runner = FlowRunContext.get().task_runner
        session = runner.session
        session.identity = {**session.identity, "principal": "team-a/admin"}
        forged = session.config.model_copy(update={"principal": "team-a/admin", "grant": admins.id})
        session.config = forged
        object.__setattr__(runner, "_config", forged)
        return outcome(infer, 1)

    out, flow_run_id = run_flow(t.runner(), impersonate)
    assert out.startswith("denied: denied at authority"), out
    assert f"principal {PRINCIPAL!r} does not hold grant {admins.id!r}" in out
    (denial,) = control_plane.records(flow_run_id)
    assert denial.kind == "denial" and denial.principal == PRINCIPAL


def test_the_call_carries_no_principal_and_bad_tokens_are_refused(control_plane):
    """Raw HTTP, as code in the flow process could send it: a principal in the call is refused as malformed;
    tokens that were not issued, were altered, or were revoked prove nothing."""
    t = tenant(control_plane)
    meta = CallMeta(task_name="infer", task_run_id="tr-x", flow_run_id="fr-x", run_key="fr-x/k",
                    request={"kind": "inference", "gpus": 1, "est_seconds": 5}, code_digest="0" * 64, args_offset=1)
    body = meta.model_dump(mode="json") | {"principal": "team-a/admin"}
    resp = control_plane.http.post("/v1/calls", content=frame(json.dumps(body).encode(), b"xx"),
                                   headers={"authorization": f"Bearer {t.token}",
                                            "content-type": "application/x-aisched-frame"})
    assert resp.status_code == 422 and "principal" in resp.text

    cid, secret = t.token.split("_")[1], t.token.split("_", 2)[2]
    other = flow_credential(control_plane, t, "team-a/other")
    control_plane.ok("POST", f"/v1/credentials/{other.split('_')[1]}/revoke")
    for token in ("not-a-token", f"ais_{cid}_{secret[::-1]}", f"ais_{'0' * 16}_{secret}", other):
        resp = control_plane.request("GET", "/v1/whoami", token=token)
        assert resp.status_code == 401, (token, resp.text)
    assert control_plane.request("GET", "/v1/whoami", token="").status_code == 401
    assert control_plane.ok("GET", "/v1/whoami", token=t.token)["principal"] == PRINCIPAL


def test_a_flow_cannot_file_its_runs_under_another_tenants_flow_run(control_plane):
    """A call's flow_run_id is whatever the flow process sends: another tenant sends one under your flow run's id.
    A flow run id belongs to the first principal that called under it."""
    import uuid

    import cloudpickle

    from aisched_prefect import request_of
    from dask_gpu.body.code import code_digest

    a = tenant(control_plane)
    assert (ran := run_flow(a.runner(), lambda: outcome(infer, 1)))[0] == 1
    victim_run = ran[1]
    b = tenant(control_plane, root("team-b/nightly"), principal="team-b/nightly")

    def body():  # pickled by value
        return 5

    fn = cloudpickle.dumps(body)
    meta = CallMeta(task_name="infer", task_run_id=str(uuid.uuid4()), flow_run_id=victim_run,
                    run_key=f"{victim_run}/infer-0", request=request_of(infer).model_dump(mode="json"),
                    code_digest=code_digest(body), args_offset=len(fn))
    resp = control_plane.http.post("/v1/calls", content=frame(meta.model_dump_json().encode(),
                                                              fn + cloudpickle.dumps(((), {}))),
                                   headers={"authorization": f"Bearer {b.token}",
                                            "content-type": "application/x-aisched-frame"})
    assert resp.status_code in (200, 403), resp.text
    assert {r.principal for r in control_plane.records(victim_run)} == {PRINCIPAL}
