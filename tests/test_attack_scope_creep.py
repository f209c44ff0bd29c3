"""Scope-creep delegation, tried in several forms: directly, down a chain, from many threads, from other processes.

Each attempt must be refused with the dimension named, leave a 'delegation-refused' record, and
leave no broader grant behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from aisched_prefect import Ledger
from aisched_prefect.grants import authority_map, delegate_grant
from blocks import AuthorityBlock, DelegationRefused, Grant, violations

pytestmark = pytest.mark.usefixtures("prefect_api")

ROOT = AuthorityBlock(grants=[Grant(id="root", principal="team-a/*", kinds=["inference"], max_gpus=2,
                                    max_cost_per_run=5, can_delegate=True)])
WIDER = [{"max_gpus": 4}, {"kinds": ["training"]}, {"kinds": ["*"]}, {"max_cost_per_run": 50}, {"can_approve": True}]


def no_grant_wider_than_its_parent(ledger: Ledger) -> None:
    roots = {g.id: g for g in ROOT.grants}
    stored = ledger.delegated_grants()
    for g in stored.values():
        parent = roots.get(g.parent) or stored[g.parent]
        assert violations(parent, g) == [], g


@pytest.mark.parametrize("wider", WIDER, ids=lambda w: next(iter(w)))
def test_direct_and_chained_widening_is_refused_and_recorded(sqlite_url, wider):
    ledger = Ledger(sqlite_url)
    with pytest.raises(DelegationRefused) as direct:
        delegate_grant("root", id="direct", principal="team-a/x", by="mallory", authority=ROOT, ledger=ledger, **wider)
    delegate_grant("root", id="mid", principal="team-a/mid", by="alice", authority=ROOT, ledger=ledger, can_delegate=True)
    with pytest.raises(DelegationRefused) as chained:  # one hop down: still bounded by the root
        delegate_grant("mid", id="chained", principal="team-a/y", by="team-a/mid", authority=ROOT, ledger=ledger, **wider)
    dimension = next(iter(wider))
    assert direct.value.dimension == chained.value.dimension == dimension
    refused = [r for r in ledger.records() if r.kind == "delegation-refused"]
    assert [r.payload["grant"] for r in refused] == ["direct", "chained"]
    assert all(r.payload["dimension"] == dimension for r in refused)
    assert set(ledger.delegated_grants()) == {"mid"}
    no_grant_wider_than_its_parent(ledger)


def test_many_threads_racing_to_widen(sqlite_url):
    ledger = Ledger(sqlite_url)
    errors: list[Exception] = []

    def attempt(i: int) -> None:
        try:
            delegate_grant("root", id=f"t{i}", principal=f"team-a/t{i}", by=f"agent-{i}", authority=ROOT,
                           ledger=ledger, **WIDER[i % len(WIDER)])
        except DelegationRefused as exc:
            errors.append(exc)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 20 and ledger.delegated_grants() == {}
    assert sum(r.kind == "delegation-refused" for r in ledger.records()) == 20
    assert ledger.verify().ok


def test_separate_processes_trying_to_widen(sqlite_url):
    """The CLI from other processes, against the same ledger: each refused, each recorded, none stored."""
    from prefect.settings import PREFECT_API_URL

    ROOT.save("scope-creep-root", overwrite=True)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    cli = os.path.join(os.path.dirname(sys.executable), "aisched")
    procs = [subprocess.Popen([cli, "grants", "delegate", "root", "--id", f"p{i}", "--to", f"team-a/p{i}",
                               "--by", f"agent-{i}", "--authority", "scope-creep-root", "--max-gpus", "8",
                               "--ledger", sqlite_url], env=env, stdout=subprocess.PIPE, text=True)
             for i in range(4)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [1, 1, 1, 1]
    assert all("(max_gpus)" in out for out in outputs), outputs
    ledger = Ledger(sqlite_url)
    assert ledger.delegated_grants() == {}
    assert sum(r.kind == "delegation-refused" for r in ledger.records()) == 4
    assert all(row.status == "active" for row in authority_map(ROOT, ledger))
