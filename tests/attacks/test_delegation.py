"""Attack 4 and scope creep: delegation is an act of the parent grant's holder, and it only ever narrows.

Before: `aisched grants delegate PARENT --by X` never checked that X held PARENT (team-b/mallory delegated team-a's
root to herself and trained on 2 GPUs). Now a delegation is an API call whose caller's credential must hold the
parent (or be an operator's); anything wider than the parent is refused naming the dimension, and every refusal is
an evidence record.
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa

from tests.attacks.support import (
    flow_credential,
    infer,
    kinds,
    outcome,
    root,
    run_flow,
    runner_for,
    tenant,
    train,
    uid,
)

pytestmark = pytest.mark.usefixtures("prefect_api")


def refusals(plane, grant_id: str) -> list:
    return [r for r in plane.ledger().records() if r.kind == "delegation-refused" and r.payload["grant"] == grant_id]


def delegations(plane, grant_id: str) -> list:
    return [r for r in plane.ledger().records() if r.kind == "delegation" and r.payload["grant"]["id"] == grant_id]


def test_a_non_holder_cannot_delegate_and_the_attempt_is_recorded(control_plane):
    lead_root = root("team-a/lead", can_delegate=True, can_approve=True)
    t = tenant(control_plane, lead_root, principal="team-a/lead")
    other = tenant(control_plane)  # team-b/mallory's own tenant, another authority
    mallory_here = flow_credential(control_plane, t, "team-b/mallory")
    mallory_there = control_plane.issue("team-b/mallory", authority=other.authority, budget=other.budget, tenant="team-b")
    approver = control_plane.approver("alice", t.authority)  # may approve, holds no grant to delegate from
    # Under her own authority the parent does not even exist: refused as a broken chain (422, naming the grant).
    for who, token, dimension, status in (("team-b/mallory", mallory_here, "by", 403),
                                          ("team-b/mallory", mallory_there, "chain", 403), ("alice", approver, "by", 403)):
        child = uid("stolen")
        resp = control_plane.delegate(lead_root.id, token, id=child, principal="team-b/mallory", max_gpus=2)
        assert resp.status_code == status, resp.text
        (refused,) = refusals(control_plane, child)
        assert refused.principal == who and refused.payload["by"] == who and refused.payload["dimension"] == dimension
        assert delegations(control_plane, child) == []

    # Nothing was given, so naming the grant mallory tried to take gets her nothing.
    out, _ = run_flow(runner_for(control_plane, mallory_here, grant=lead_root.id), lambda: outcome(infer, 1))
    assert f"principal 'team-b/mallory' does not hold grant {lead_root.id!r}" in out


def test_a_holders_delegation_works_and_only_ever_narrows(control_plane):
    expires = datetime.now(timezone.utc) + timedelta(days=1)
    lead_root = root("team-a/lead", can_delegate=True, expires_at=expires, kinds=["inference", "training"])
    t = tenant(control_plane, lead_root, principal="team-a/lead")
    agent = flow_credential(control_plane, t, "team-a/agent")
    mid = flow_credential(control_plane, t, "team-a/mid")

    wider = [({"max_gpus": 8}, "max_gpus"), ({"kinds": ["*"]}, "kinds"), ({"kinds": ["fine-tuning"]}, "kinds"),
             ({"max_cost_per_run": 1000}, "max_cost_per_run"), ({"can_approve": True}, "can_approve"),
             ({"expires_at": (expires + timedelta(days=30)).isoformat()}, "expires_at"),
             ({"max_priority": 50}, "max_priority")]
    for dims, dimension in wider:
        child = uid("wide")
        resp = control_plane.delegate(lead_root.id, t.token, id=child, principal="team-a/agent", **dims)
        assert resp.status_code == 403 and resp.json()["field"] == dimension, (dims, resp.text)
        (refused,) = refusals(control_plane, child)
        assert refused.payload["dimension"] == dimension and refused.payload["by"] == "team-a/lead"
    pattern = control_plane.delegate(lead_root.id, t.token, id=uid("glob"), principal="team-a/*")
    assert pattern.status_code == 403 and pattern.json()["field"] == "principal"

    narrow, middle = uid("narrow"), uid("mid")
    assert control_plane.delegate(lead_root.id, t.token, id=narrow, principal="team-a/agent", max_gpus=1,
                                  kinds=["inference"]).status_code == 200
    assert control_plane.delegate(lead_root.id, t.token, id=middle, principal="team-a/mid", max_gpus=2,
                                  can_delegate=True).status_code == 200
    # One hop down, still bounded by the grant above: mid may not hand out more than its own 2 GPUs.
    chained = control_plane.delegate(middle, mid, id=uid("chained"), principal="team-a/agent", max_gpus=4)
    assert chained.status_code == 403 and chained.json()["field"] == "max_gpus"
    # The agent was not given the right to delegate.
    deeper = control_plane.delegate(narrow, agent, id=uid("deeper"), principal="team-a/x")
    assert deeper.status_code == 403 and deeper.json()["field"] == "can_delegate"

    (inferred, trained), flow_run_id = run_flow(runner_for(control_plane, agent),
                                                lambda: (outcome(infer, 1), outcome(train)))
    assert inferred == 1
    assert trained.startswith("denied: denied at authority") and "allows kinds ['inference']" in trained
    admission = next(r for r in control_plane.records(flow_run_id) if r.kind == "admission")
    assert admission.payload["chain"] == [lead_root.id, narrow]
    assert set(admission.payload["grant_versions"]) == {lead_root.id, narrow}


def test_many_threads_racing_to_widen_are_each_refused_and_recorded(control_plane):
    lead_root = root("team-a/lead", can_delegate=True, max_gpus=2, kinds=["inference"])
    t = tenant(control_plane, lead_root, principal="team-a/lead")
    attempts = [{"max_gpus": 4}, {"kinds": ["training"]}, {"max_cost_per_run": 50}, {"can_approve": True}]
    ids = [uid(f"race{i}") for i in range(16)]
    codes: list[int] = []

    def attempt(i: int) -> None:
        codes.append(control_plane.delegate(lead_root.id, t.token, id=ids[i], principal=f"team-a/t{i}",
                                            **attempts[i % len(attempts)]).status_code)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(len(ids))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert codes == [403] * len(ids)
    records = control_plane.ledger().records()
    assert sorted(r.payload["grant"] for r in records if r.kind == "delegation-refused" and r.payload["grant"] in ids) \
        == sorted(ids)
    assert not any(r.kind == "delegation" and r.payload["grant"]["id"] in ids for r in records)
    assert control_plane.ledger().verify().ok


def test_a_delegated_grant_widened_in_the_database_authorizes_nothing_more(own_plane):
    """Someone with the database widens the delegation's record: the control plane acts on what it folded from the
    chain, and the edit breaks the chain. (On a control plane of its own: it breaks that ledger's chain.)"""
    from aisched_prefect.ledger import evidence

    control_plane = own_plane()
    lead_root = root("team-a/lead", can_delegate=True)
    t = tenant(control_plane, lead_root, principal="team-a/lead")
    small = uid("small")
    assert control_plane.delegate(lead_root.id, t.token, id=small, principal="team-a/x", max_gpus=1).status_code == 200
    ledger = control_plane.ledger()
    with ledger.engine.begin() as conn:
        seq, payload = next((r.seq, r.payload) for r in conn.execute(
            sa.select(evidence.c.seq, evidence.c.payload).where(evidence.c.kind == "delegation"))
            if r.payload["grant"]["id"] == small)
        wider = {**payload, "grant": {**payload["grant"], "max_gpus": 64}}
        conn.execute(sa.update(evidence).where(evidence.c.seq == seq).values(payload=wider))
    out, _ = run_flow(runner_for(control_plane, flow_credential(control_plane, t, "team-a/x")), lambda: outcome(train))
    assert out.startswith("denied: denied at authority") and "max_gpus=1, not gpus=2" in out
    assert not ledger.verify().ok


def test_a_holder_or_a_flow_cannot_revoke_grants_that_are_not_below_its_own(control_plane):
    lead_root = root("team-a/lead", can_delegate=True)
    t = tenant(control_plane, lead_root, principal="team-a/lead")
    child = uid("child")
    assert control_plane.delegate(lead_root.id, t.token, id=child, principal="team-a/agent").status_code == 200
    agent = flow_credential(control_plane, t, "team-a/agent")
    assert control_plane.revoke(child, token=agent).status_code == 403  # its own grant: only what is above it may
    assert control_plane.revoke(lead_root.id, token=t.token).status_code == 403  # a root: operators only
    out, _ = run_flow(runner_for(control_plane, agent), lambda: outcome(infer, 3))
    assert out == 3


def test_a_holder_cannot_revoke_another_authoritys_root_through_a_colliding_id(control_plane):
    """Grant ids are unique only within one authority: mallory names a child of her own root like the victim's root
    and revokes it. The revocation names her authority, so the victim's root stands."""
    victim_root = root("team-b/victim")
    victim = tenant(control_plane, victim_root, principal="team-b/victim")
    assert run_flow(victim.runner(), lambda: outcome(infer, 1))[0] == 1
    mallory_root = root("team-a/mallory", can_delegate=True)
    mallory = tenant(control_plane, mallory_root, principal="team-a/mallory")
    # A child of her own root, named like the victim's root; then she revokes her own child.
    if control_plane.delegate(mallory_root.id, mallory.token, id=victim_root.id,
                              principal="team-a/mallory").status_code == 200:
        control_plane.revoke(victim_root.id, token=mallory.token)
    out, _ = run_flow(victim.runner(), lambda: outcome(infer, 2))
    assert out == 2, out


def test_a_delegation_under_one_authority_gives_nothing_under_another(control_plane):
    shared = uid("team-root")  # two operators who both call their tenant's root grant the same thing
    a = tenant(control_plane, root("team-a/alice", id=shared, can_delegate=True), principal="team-a/alice")
    b = tenant(control_plane, root("team-b/owner", id=shared, can_delegate=True), principal="team-b/owner")
    child = uid("gift")
    assert control_plane.delegate(shared, a.token, id=child, principal="team-b/intruder", max_gpus=2).status_code == 200
    # team-b/intruder has a credential for authority B, where nobody granted it anything.
    intruder = flow_credential(control_plane, b, "team-b/intruder")
    out, flow_run_id = run_flow(runner_for(control_plane, intruder), lambda: outcome(infer, 1))
    assert out.startswith("denied: denied at authority"), out
    assert kinds(control_plane.records(flow_run_id)) == ["denial"]
