"""An operator's apply: refused changes leave nothing behind, and a bad record already in the log does not block
the applies after it. The control plane's own `apply`, on a real ledger and authority state (no cluster: applying
configuration reaches neither Dask nor Prefect)."""

from __future__ import annotations

import pytest

from aisched_prefect.control.authority import records
from aisched_prefect.control.authority.configuration import Configuration
from aisched_prefect.control.service import ControlPlane, load_or_make_key
from aisched_prefect.control.authority.state import AuthorityState, block_body
from aisched_prefect.errors import InvalidConfig
from aisched_prefect.ledger import Ledger
from blocks import AuthorityBlock, BudgetBlock, BudgetLimit, Grant
from dask_gpu.tickets import TicketSigner


@pytest.fixture
def plane(sqlite_url, tmp_path):
    """The parts of a control plane an apply uses: its ledger (records signed by its key) and its folded state."""
    p = ControlPlane.__new__(ControlPlane)
    p.signer = TicketSigner(load_or_make_key(tmp_path / "control.key"))
    p.ledger = Ledger(sqlite_url, signer=p.signer.sign)
    p.state = AuthorityState(p.ledger, trusted=[p.signer.public_key])
    p.configuration = Configuration(p.ledger, p.state, on_cluster_applied=lambda: None)  # no queue (--no-queue)
    yield p
    p.ledger.close()


def budget(limit: float = 100.0, *limits: BudgetLimit) -> dict:
    return block_body(BudgetBlock(limit=limit, limits=list(limits), gpu_hour_prices={"H100": 4.0}))


def authority() -> dict:
    return block_body(AuthorityBlock(grants=[Grant(id="root", principal="team-a/x", max_gpus=2, max_cost_per_run=5.0)]))


def _kinds(plane) -> list[str]:
    return [r.kind for r in plane.ledger.records()]


@pytest.mark.parametrize("name, rule", [
    ("b" * 5000, "1 to 100 characters"),
    ("team\x00a", "only letters, digits"),
    ("team/a", "only letters, digits"),
    ("-team", "starts with a letter or digit"),
    ("team-a\n", "only letters, digits"),
])
def test_a_refused_name_records_nothing_and_blocks_nothing(plane, name, rule):
    with pytest.raises(InvalidConfig, match=f"budget name=.*{rule}.*Fix: name the budget block like a Prefect block"):
        plane.configuration.apply("operator", "budget", name, budget())
    assert _kinds(plane) == [] and plane.state.refresh().configs == {}
    for kind, body in (("budget", budget()), ("authority", authority())):  # the applies after it go through
        plane.configuration.apply("operator", kind, "team-a", body)
    assert {k for k, _ in plane.state.refresh().configs} == {"budget", "authority"}
    assert [x["budget"] for x in plane.ledger.limits()] == ["team-a"]


def test_a_budget_whose_accounts_cannot_be_booked_records_nothing(plane):
    """The name fits, but an account (<budget>/<limit>) would be longer than the books hold: refused whole."""
    long = BudgetLimit(name="l" * 190, amount=10.0)
    with pytest.raises(InvalidConfig, match="the ledger cannot book its accounts.*Fix: shorten"):
        plane.configuration.apply("operator", "budget", "team-a-" + "x" * 20, budget(100.0, long))
    assert _kinds(plane) == [] and plane.ledger.limits() == []


def test_a_bad_record_already_in_the_log_does_not_poison_later_applies(plane):
    """A budget applied before names were checked (its record is in the chain, signed) is left out of the limits;
    every apply after it is recorded once and its limits applied."""
    bad = "b" * 5000
    records.record(plane.ledger, records.ConfigApplied(config_kind="budget", name=bad, version=1, digest="0" * 64,
                                                       body=budget(), by="operator"), principal="operator")
    plane.configuration.apply("operator", "budget", "team-a", budget(50.0))
    plane.configuration.apply("operator", "authority", "team-a", authority())
    plane.configuration.apply("operator", "budget", "team-a", budget(40.0))  # a cut, applied
    assert _kinds(plane).count("config-applied") == 4
    assert [(x["budget"], x["limit"]) for x in plane.ledger.limits()] == [("team-a", 40.0)]
    assert plane.ledger.verify().ok
