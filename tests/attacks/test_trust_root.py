"""Attack 1, its own trust root: a flow brings its own authority, its own ledger, or its own control plane.

Before: an inline AuthorityBlock or a ledger the flow chose authorized a grant the team had revoked and spent the
team's budget a second time outside its ledger. Now the runner refuses inline objects, the ledger is the control
plane's alone, and a control plane a flow starts for itself holds neither the key the workers trust nor the
certificate the cluster's scheduler asks for.
"""

from __future__ import annotations

import gc

import dask
import pytest
from distributed import Client

from aisched_prefect import AISchedTaskRunner, ConfigurationError
from blocks import ApprovalPolicyBlock, ClusterBlock
from tests.attacks.support import authority, budget, infer, kinds, outcome, root, run_flow, tenant

pytestmark = pytest.mark.usefixtures("prefect_api")


@pytest.mark.parametrize("argument, value, match", [
    ("authority", authority(root("team-a/nightly", max_gpus=64, max_cost_per_run=1e9)), "not a AuthorityBlock object"),
    ("budget", budget(limit=1e9), "not a BudgetBlock object"),
    ("approval_policy", ApprovalPolicyBlock(rules=[]), "not a ApprovalPolicyBlock object"),
    ("cluster", ClusterBlock(), "not a ClusterBlock object"),
    ("ledger_url", "sqlite:///mine.db", "ledger_url=...\\) is refused: the ledger belongs to the control plane"),
    ("address", "tcp://127.0.0.1:8786", "address=...\\) is refused"),
    ("ticket_ttl_seconds", 1e9, "is refused: tickets are the control plane's"),
])
def test_the_runner_refuses_authority_objects_and_trust_roots_from_the_flow(argument, value, match):
    with pytest.raises(ConfigurationError, match=match):
        AISchedTaskRunner(principal="team-a/nightly", **{"authority": "a", "budget": "b", argument: value})


def test_a_ledger_chosen_in_the_flow_process_environment_changes_nothing(control_plane, tmp_path, monkeypatch):
    """AISCHED_LEDGER_URL / AISCHED_HOME set by the flow: its runs are still booked, and revoked, in the plane's ledger."""
    grant = root()
    t = tenant(control_plane, grant)
    mine = tmp_path / "mine.db"
    monkeypatch.setenv("AISCHED_LEDGER_URL", f"sqlite:///{mine}")
    monkeypatch.setenv("AISCHED_HOME", str(tmp_path / "home"))

    first, first_run = run_flow(t.runner(), lambda: outcome(infer, 1))
    assert first == 1
    assert kinds(control_plane.records(first_run)) == ["admission", "settlement"]
    spent = next(a for a in control_plane.ledger().accounts() if a["budget"].split("/")[0] == t.budget)
    assert spent["posted"] > 0  # charged to the team's account in the control plane's ledger

    control_plane.revoke(grant.id, reason="incident")
    again, again_run = run_flow(t.runner(), lambda: outcome(infer, 2))
    assert again.startswith("denied: denied at authority") and f"grant {grant.id!r} is revoked" in again
    assert kinds(control_plane.records(again_run)) == ["denial"]
    assert not mine.exists()  # nothing was ever written where the flow pointed
    assert control_plane.ledger().verify().ok


def test_a_control_plane_the_flow_starts_itself_cannot_reach_the_cluster(gpu_cluster, tmp_path):
    """The flow runs `aisched serve --dask-address <the real cluster>` with a home of its own: no client certificate
    (or one from a CA it made itself), so the scheduler never lets it connect."""
    from aisched_prefect.control.service import ControlPlane
    from aisched_prefect.settings import Settings
    from dask_gpu.security import ClusterTLS

    address = gpu_cluster.scheduler_address
    assert address.startswith("tls://")
    own_ca = ClusterTLS.create(tmp_path / "own-tls")
    with dask.config.set({"distributed.comm.timeouts.connect": "3s"}):
        for n, dask_tls in enumerate((None, own_ca.directory)):
            with pytest.raises(Exception) as refused:
                ControlPlane(Settings(home=tmp_path / f"home-{n}"), dask_address=address, dask_tls=dask_tls)
            assert not isinstance(refused.value, AssertionError), refused.value
            # The refused Dask client is collected here, not inside another client's close (distributed's
            # class-wide LoopRunner lock: collected there, its close waits on that lock forever).
            del refused
            gc.collect()


def test_tickets_signed_by_a_key_of_the_flows_own_are_refused_by_every_worker(dask_client):
    """Even handed to a worker by a client the cluster trusts, a ticket from the flow's own control plane's key is
    refused: workers trust only the keys they were started with."""
    from dask_gpu.worker.sandbox import Body, run_ticketed
    from dask_gpu.tickets import TicketRejected, TicketSigner, digest

    stranger = TicketSigner.generate()
    body = Body(payload=b"never unpickled")
    ticket = stranger.issue(run="mine", payload_digest=digest(body.payload), code_digest="0" * 64,
                            request=__import__("dask_gpu").GPURequest(gpus=0))
    futures = [dask_client.submit(run_ticketed, ticket, body, workers=[w], pure=False, allow_other_workers=False)
               for w in ("gpu-worker-0", "gpu-worker-1", "gpu-worker-2")]
    for f in futures:
        with pytest.raises(TicketRejected, match="was not started to trust"):
            f.result(timeout=60)
