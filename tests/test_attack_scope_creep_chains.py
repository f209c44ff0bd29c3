"""Scope creep through stored chains: a delegation wider than its parent, or widened after the fact, authorizes nothing."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from prefect import flow

from aisched_prefect import Ledger
from aisched_prefect.grants import delegate_grant
from aisched_prefect.ledger import grants as grants_table
from blocks import DelegationRefused, Grant
from tests.authority_helpers import ROOT, infer, outcome
from tests.helpers import runner

pytestmark = pytest.mark.usefixtures("prefect_api")


def test_delegation_wider_than_its_parent_is_refused(sqlite_url):
    ledger = Ledger(sqlite_url)
    with pytest.raises(DelegationRefused, match=r"\(max_gpus\)"):
        delegate_grant("team-a-root", id="wide", principal="team-a/x", by="alice", authority=ROOT, ledger=ledger,
                       max_gpus=8)
    delegate_grant("team-a-root", id="narrow", principal="team-a/x", by="alice", authority=ROOT, ledger=ledger,
                   max_gpus=1)
    with pytest.raises(DelegationRefused, match=r"\(can_delegate\)"):  # narrow was not given the right to delegate
        delegate_grant("narrow", id="deeper", principal="team-a/y", by="team-a/x", authority=ROOT, ledger=ledger)
    assert [r.kind for r in ledger.records()] == ["delegation-refused", "delegation", "delegation-refused"]


def test_a_stored_grant_widened_after_the_fact_breaks_its_chain(gpu_cluster, sqlite_url):
    ledger = Ledger(sqlite_url)
    delegate_grant("team-a-root", id="small", principal="team-a/x", by="alice", authority=ROOT, ledger=ledger,
                   max_gpus=1)
    widened = Grant(id="small", principal="team-a/x", parent="team-a-root", max_gpus=64, max_cost_per_run=10)
    with ledger.engine.begin() as conn:  # someone edits the ledger directly
        conn.execute(sa.update(grants_table).where(grants_table.c.id == "small").values(body=widened.model_dump(mode="json")))

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority=ROOT, principal="team-a/x",
                             grant="small"))
    def f():
        return outcome(infer, 1)

    assert "'small' is wider than its parent 'team-a-root' in max_gpus" in f()
