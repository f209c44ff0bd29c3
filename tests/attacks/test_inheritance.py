"""Attack 5, implicit inheritance: a principal's authority is the grants issued or delegated to it, nothing else.

Before: a root grant to `team-a/*` covered `team-a/nightly` without any act; after the README's own
`revoke_grant("nightly")` the same flow, without `grant=`, ran 4 GPUs under the root; a grant restricted to
`models=["llama-8b"]` admitted a task that declared no model; sub-flows shared their parent's session.
"""

from __future__ import annotations

import pytest
from prefect import flow

from aisched_prefect import NoAdmissionContext
from aisched_prefect.control.authority.state import block_body
from tests.attacks.support import (
    authority,
    flow_credential,
    infer,
    kinds,
    outcome,
    root,
    run_flow,
    runner_for,
    tenant,
    uid,
)

pytestmark = pytest.mark.usefixtures("prefect_api")


@pytest.mark.parametrize("grants, groups, match", [
    ([root("team-a/*")], {}, "is a pattern: name one principal"),
    ([root("team-?/nightly")], {}, "is a pattern"),
    ([root("group:team-a")], {}, "no group 'team-a' in groups"),
    ([root("group:team-a")], {"team-a": ["team-a/*"]}, "must be one exact principal"),
])
def test_a_grant_to_a_pattern_cannot_be_applied(control_plane, grants, groups, match):
    resp = control_plane.request("POST", f"/v1/config/authority/{uid('pattern')}",
                                 json=block_body(authority(*grants, groups=groups)))
    assert resp.status_code == 400 and match in resp.json()["error"], resp.text


def test_a_group_grant_is_held_by_its_declared_members_only(control_plane):
    t = tenant(control_plane, root("group:leads"), principal="team-a/lead", groups={"leads": ["team-a/lead"]})
    assert run_flow(t.runner(), lambda: outcome(infer, 1))[0] == 1
    nightly = flow_credential(control_plane, t, "team-a/nightly")  # same team prefix, not a member
    out, _ = run_flow(runner_for(control_plane, nightly), lambda: outcome(infer, 1))
    assert "principal 'team-a/nightly' holds no grant" in out


def test_after_its_grant_is_revoked_a_flow_falls_back_on_nothing(control_plane):
    """The README's revoke, then the same flow without grant=: the lead's root is not the agent's to fall back on."""
    lead_root = root("team-a/lead", can_delegate=True)
    t = tenant(control_plane, lead_root, principal="team-a/lead")
    nightly = uid("nightly")
    assert control_plane.delegate(lead_root.id, t.token, id=nightly, principal="team-a/agent", max_gpus=1).status_code == 200
    agent = flow_credential(control_plane, t, "team-a/agent")
    assert run_flow(runner_for(control_plane, agent), lambda: outcome(infer, 1))[0] == 1

    assert control_plane.revoke(nightly, token=t.token).json() == {"revoked": True}  # its delegator revokes it
    (without, named), flow_run_id = run_flow(runner_for(control_plane, agent),
                                             lambda: (outcome(infer, 2), outcome(infer, 3)))
    assert f"grant chain of {nightly!r} is broken: grant {nightly!r} is revoked" in without
    assert kinds(control_plane.records(flow_run_id)) == ["denial", "denial"]
    out, _ = run_flow(runner_for(control_plane, agent, grant=lead_root.id), lambda: outcome(infer, 4))
    assert f"principal 'team-a/agent' does not hold grant {lead_root.id!r}" in out

    # And it shows, to whoever asks afterwards: the map of who holds what, and why each run was refused.
    from typer.testing import CliRunner

    from aisched_prefect.cli import app
    from aisched_prefect.grants import authority_map

    rows = {r.grant: r for r in authority_map(control_plane.ledger(), t.authority)}
    assert rows[lead_root.id].status == "active" and rows[lead_root.id].principal == "team-a/lead"
    assert rows[nightly].status == f"broken: grant {nightly!r} is revoked" and rows[nightly].principal == "team-a/agent"
    explained = CliRunner().invoke(app, ["explain", flow_run_id, "--ledger", control_plane.ledger_url])
    assert explained.exit_code == 0 and "DENIED at authority" in explained.stdout, explained.stdout


def test_revoking_a_grant_cascades_to_everything_delegated_below_it(control_plane):
    lead_root = root("team-a/lead", can_delegate=True)
    t = tenant(control_plane, lead_root, principal="team-a/lead")
    mid, leaf = uid("mid"), uid("leaf")
    mid_token = flow_credential(control_plane, t, "team-a/mid")
    assert control_plane.delegate(lead_root.id, t.token, id=mid, principal="team-a/mid", can_delegate=True).status_code == 200
    assert control_plane.delegate(mid, mid_token, id=leaf, principal="team-a/agent").status_code == 200
    agent = flow_credential(control_plane, t, "team-a/agent")
    assert run_flow(runner_for(control_plane, agent), lambda: outcome(infer, 1))[0] == 1
    control_plane.revoke(mid, reason="the lead left")  # an operator revokes the middle link
    out, _ = run_flow(runner_for(control_plane, agent), lambda: outcome(infer, 2))
    assert f"grant chain of {leaf!r} is broken: grant {mid!r} is revoked" in out


def test_a_grant_for_someone_else_does_not_authorize_whoever_names_it(control_plane):
    lead_root = root("team-a/lead", can_delegate=True)
    t = tenant(control_plane, lead_root, principal="team-a/lead")
    for_bob = uid("for-bob")
    assert control_plane.delegate(lead_root.id, t.token, id=for_bob, principal="team-a/bob").status_code == 200
    mallory = flow_credential(control_plane, t, "team-a/mallory")
    out, _ = run_flow(runner_for(control_plane, mallory, grant=for_bob), lambda: outcome(infer, 1))
    assert f"principal 'team-a/mallory' does not hold grant {for_bob!r}" in out


def test_a_models_restricted_grant_denies_a_task_that_declares_no_model(control_plane):
    t = tenant(control_plane, root(models=["llama-8b"]))
    out, _ = run_flow(t.runner(), lambda: outcome(infer, 1))
    assert out.startswith("denied: denied at authority") and "the task declares none: set model=" in out


def test_a_sub_flow_inherits_nothing_from_its_parent(control_plane):
    t = tenant(control_plane)
    helper_token = flow_credential(control_plane, t, "team-b/helper")

    @flow(task_runner=runner_for(control_plane, helper_token))
    def helper_with_its_own_credential():
        return outcome(infer, 1)

    @flow  # no AISchedTaskRunner: the parent's is not borrowed
    def helper_without_a_runner():
        try:
            return infer(1)
        except NoAdmissionContext as exc:
            return f"refused: {exc}"

    (mine, with_own, without), _ = run_flow(t.runner(), lambda: (outcome(infer, 0), helper_with_its_own_credential(),
                                                                 helper_without_a_runner()))
    assert mine == 0
    assert "principal 'team-b/helper' holds no grant" in with_own
    assert without.startswith("refused:") and "AISchedTaskRunner" in without
