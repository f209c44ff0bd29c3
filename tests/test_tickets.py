"""No ticket, no run: forged, altered, untrusted, expired, replayed and missing tickets are refused on a real worker."""

from __future__ import annotations

import time

import pytest
from distributed import Client

from aisched_prefect import AIRequest, TicketRejected
from aisched_prefect.tickets import TicketSigner
from aisched_prefect.worker import run_admitted

REQUEST = AIRequest(kind="inference", gpus=1, gpu_type="H100", est_seconds=5)


def answer():
    return 42


@pytest.fixture
def trusted(dask_client: Client):
    signer = TicketSigner()
    signer.register(dask_client)
    yield signer
    signer.unregister(dask_client)


def run(client: Client, ticket, request=REQUEST, worker="gpu-worker-0"):
    future = client.submit(run_admitted, ticket, request, answer, (), {}, resources={"GPU": 1}, workers=[worker],
                           pure=False)
    return future.result(timeout=60)


def issue(signer: TicketSigner, seq: int, **overrides):
    fields = {"admission_seq": seq, "task_run_id": f"tr-{seq}", "request_digest": REQUEST.digest,
              "chain": ("team-a-root",), "expires_at": time.time() + 60}
    return signer.issue(**{**fields, **overrides})


def test_a_valid_ticket_runs_once(dask_client, trusted):
    ticket = issue(trusted, 1)
    assert run(dask_client, ticket).value == 42
    with pytest.raises(TicketRejected, match="already used: replay refused"):
        run(dask_client, ticket)


def test_missing_ticket(dask_client, trusted):
    with pytest.raises(TicketRejected, match="no admission ticket"):
        run(dask_client, None)


def test_ticket_from_an_untrusted_key(dask_client, trusted):
    stranger = TicketSigner()  # never registered with the cluster
    with pytest.raises(TicketRejected, match="does not trust"):
        run(dask_client, issue(stranger, 2))


def test_forged_signature_and_altered_fields(dask_client, trusted):
    good = issue(trusted, 3)
    forged = good.model_copy(update={"signature": "00" * 64})
    with pytest.raises(TicketRejected, match="bad signature"):
        run(dask_client, forged)
    widened = good.model_copy(update={"chain": ("someone-elses-root",)})  # altered after signing
    with pytest.raises(TicketRejected, match="bad signature"):
        run(dask_client, widened)


def test_ticket_for_another_request(dask_client, trusted):
    bigger = AIRequest(kind="inference", gpus=2, gpu_type="H100", est_seconds=5)
    with pytest.raises(TicketRejected, match="issued for another request"):
        run(dask_client, issue(trusted, 4), request=bigger)


def test_expired_ticket(dask_client, trusted):
    with pytest.raises(TicketRejected, match="expired"):
        run(dask_client, issue(trusted, 5, expires_at=time.time() - 1))


def test_unregistered_key_is_no_longer_trusted(dask_client):
    signer = TicketSigner()
    signer.register(dask_client)
    assert run(dask_client, issue(signer, 6)).value == 42
    signer.unregister(dask_client)
    with pytest.raises(TicketRejected, match="does not trust"):
        run(dask_client, issue(signer, 7))
