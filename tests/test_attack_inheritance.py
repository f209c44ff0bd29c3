"""Implicit trust inheritance, tried: sub-flows and other principals act only on what they were given."""

from __future__ import annotations

import pytest
from prefect import flow

from aisched_prefect import Ledger, NoAdmissionContext
from aisched_prefect.grants import delegate_grant
from tests.authority_helpers import ROOT, infer, outcome
from tests.helpers import runner

pytestmark = pytest.mark.usefixtures("prefect_api")


def test_a_grant_for_someone_else_does_not_authorize(gpu_cluster, sqlite_url):
    ledger = Ledger(sqlite_url)
    delegate_grant("team-a-root", id="for-bob", principal="team-a/bob", by="alice", authority=ROOT, ledger=ledger)

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority=ROOT, principal="team-a/mallory",
                             grant="for-bob"))
    def mallory():
        return outcome(infer, 1)

    assert "is for 'team-a/bob', not for principal 'team-a/mallory'" in mallory()


def test_a_sub_flow_inherits_nothing_from_its_parent(gpu_cluster, sqlite_url):
    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority=ROOT, principal="team-b/helper"))
    def helper_with_own_runner():
        return outcome(infer, 1)

    @flow  # no AISchedTaskRunner of its own
    def helper_without_runner():
        try:
            return infer(1)
        except NoAdmissionContext as exc:
            return f"refused: {exc}"

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority=ROOT, principal="team-a/boss"))
    def parent():
        return outcome(infer, 0), helper_with_own_runner(), helper_without_runner()

    mine, sub_with_runner, sub_without = parent()
    assert mine == 0  # the parent's own grant works for the parent
    assert "principal 'team-b/helper' holds no grant" in sub_with_runner
    assert sub_without.startswith("refused:") and "AISchedTaskRunner" in sub_without


def test_many_sub_flows_at_once_each_on_their_own_authority(gpu_cluster, sqlite_url):
    """Four sub-flows run concurrently beside a parent with a broad grant: none borrows it."""
    from concurrent.futures import ThreadPoolExecutor

    def helper(i: int) -> str:
        @flow(name=f"helper-{i}", task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority=ROOT,
                                                     principal=f"team-b/helper-{i}"))
        def sub():
            return outcome(infer, i)

        return sub()

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority=ROOT, principal="team-a/boss"))
    def parent():
        with ThreadPoolExecutor(4) as pool:
            return outcome(infer, 0), list(pool.map(helper, range(4)))

    mine, helpers = parent()
    assert mine == 0
    assert all(f"principal 'team-b/helper-{i}' holds no grant" in h for i, h in enumerate(helpers))
    denials = [r for r in Ledger(sqlite_url).records() if r.kind == "denial"]
    assert sorted(r.principal for r in denials) == [f"team-b/helper-{i}" for i in range(4)]


def test_a_flow_in_another_process_gets_no_authority_from_this_one(gpu_cluster, sqlite_url, tmp_path):
    """A separate process (say, an agent's own script) on the same cluster and ledger, without a grant."""
    import os
    import subprocess
    import sys

    from prefect.settings import PREFECT_API_URL

    script = tmp_path / "outsider.py"
    script.write_text(f'''
from prefect import flow
from aisched_prefect import AISchedTaskRunner, AdmissionDenied, ai_task
from blocks import AuthorityBlock, BudgetBlock, Grant

@ai_task(gpus=1, kind="inference", est_seconds=5)
def infer(i):
    return i

@flow(task_runner=AISchedTaskRunner(
    principal="team-b/outsider", address={gpu_cluster.scheduler_address!r}, ledger_url={sqlite_url!r},
    authority=AuthorityBlock(grants=[Grant(id="team-a-root", principal="team-a/*", max_gpus=4, max_cost_per_run=10)]),
    budget=BudgetBlock(limit=10, gpu_hour_prices={{"*": 1.0}})))
def outsider():
    try:
        return infer(1)
    except AdmissionDenied as exc:
        return "denied: " + str(exc)

print(outsider())
''')
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_LOGGING_LEVEL": "ERROR"}

    @flow(task_runner=runner(gpu_cluster.scheduler_address, sqlite_url, authority=ROOT, principal="team-a/boss"))
    def parent():
        mine = outcome(infer, 0)
        child = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180)
        return mine, child.stdout

    mine, printed = parent()
    assert mine == 0
    assert "denied: denied at authority: principal 'team-b/outsider' holds no grant" in printed
    denial = [r for r in Ledger(sqlite_url).records() if r.kind == "denial"]
    assert [r.principal for r in denial] == ["team-b/outsider"]
