"""Attack 6, Dask as an open door, and ticket replay.

Before: every flow process held a Dask client and Dask trusts all clients: `client.submit(..., resources={"GPU": 1})`,
`dask_gpu.submit`, `run_admitted` with a ticket key the client registered itself, and the raw body through
prefect-dask's runner all ran on GPU workers with devices and no record; a ticket read from the scheduler ran again
on the other worker, and on the same worker after its restart. Now the cluster speaks only mutual TLS with the
control plane's client certificate, workers trust only the control plane's key fixed at their start, and a ticket
binds the exact bytes and is redeemed once for the whole cluster.

The ticket tests hand `run_ticketed` to the workers through the test harness's own client (the operator's: a flow
has none), signing with the session control plane's key where a test needs a ticket the workers trust.
"""

from __future__ import annotations

import asyncio
import time

import cloudpickle
import dask
import pytest
from distributed import Client

from aisched_prefect import TicketRejected
from dask_gpu import GPURequest
from dask_gpu.body.code import code_digest
from dask_gpu.worker.sandbox import Body, Outcome, run_ticketed
from dask_gpu.security import ClusterTLS
from dask_gpu.tickets import TicketSigner, digest
from tests.attacks.support import run_flow, tenant
from tests.helpers import workers_info


def connect_client(address: str, **args) -> None:
    """Connect a Dask client as an attacker would; raises where the cluster refuses it.

    Asynchronous, so a refused client leaves no loop thread behind: a synchronous Client whose constructor fails
    is closed by the garbage collector, and when that lands inside another client's close, both wait on
    distributed's class-wide LoopRunner lock forever (CI hung 300 s here)."""

    async def attempt() -> None:
        client = Client(address, asynchronous=True, set_as_default=False, **args)
        try:
            await client
        finally:
            await client.close()

    asyncio.run(attempt())

REQUEST = GPURequest(gpus=1, gpu_type="H100")


def _bodies():
    """Functions pickled by value (defined in a function), so a body's process need not import this test module."""

    def answer():
        return 42

    def something_else():
        return "not what was admitted"

    return answer, something_else


answer, something_else = _bodies()


@pytest.fixture(scope="module")
def signer(plane_home) -> TicketSigner:
    """The control plane's own key, as only the control plane holds it."""
    from aisched_prefect.control.service import load_or_make_key

    return TicketSigner(load_or_make_key(plane_home / "control.key"))


def body_of(fn) -> Body:
    return Body(payload=cloudpickle.dumps(fn) + cloudpickle.dumps(((), {})))


def ticket_for(signer: TicketSigner, body: Body, fn=answer, **kw):
    return signer.issue(run=f"attack-{time.monotonic_ns()}", payload_digest=digest(body.payload),
                        code_digest=code_digest(fn), request=REQUEST, **kw)


def run(client: Client, ticket, body: Body, worker: str = "gpu-worker-0") -> Outcome:
    future = client.submit(run_ticketed, ticket, body, workers=[worker], allow_other_workers=False,
                           resources=REQUEST.resources(), pure=False)
    return future.result(timeout=60)


@pytest.fixture(scope="module")
def quick_connect():
    with dask.config.set({"distributed.comm.timeouts.connect": "3s"}):
        yield


def test_without_the_clusters_client_certificate_nothing_connects(gpu_cluster, dask_client, tmp_path, quick_connect):
    """No certificate, a certificate from a CA of its own, or plain TCP: neither the scheduler nor any worker answers."""
    from distributed.comm import connect

    scheduler = gpu_cluster.scheduler_address
    workers = list(workers_info(dask_client))
    own = ClusterTLS.create(tmp_path / "own").security("client")
    for attempt in (dict(), dict(security=own)):
        with pytest.raises(Exception) as refused:
            connect_client(scheduler, timeout=3, **attempt)
        assert "TLS" in str(refused.value) or isinstance(refused.value, (OSError, AssertionError)), refused.value
    with pytest.raises(Exception):
        connect_client(scheduler.replace("tls://", "tcp://"), timeout=3)

    async def talk(address: str, **args) -> object:
        comm = await connect(address, timeout="3s", **args)
        try:
            await comm.write({"op": "identity", "reply": True})
            return await comm.read()
        finally:
            comm.abort()

    for address in [scheduler, *workers]:
        with pytest.raises(Exception):
            asyncio.run(talk(address, **own.get_connection_args("client")))
        with pytest.raises(Exception):
            asyncio.run(talk(address.replace("tls://", "tcp://")))


@pytest.mark.usefixtures("prefect_api")
def test_a_flow_process_has_no_dask_client_and_prefect_dask_cannot_connect(control_plane, gpu_cluster, quick_connect):
    from distributed import default_client
    from prefect import flow, task
    from prefect_dask import DaskTaskRunner

    def look_for_a_client():
        try:
            default_client()
        except ValueError as exc:
            return f"none: {exc}"
        return "found one"

    out, _ = run_flow(tenant(control_plane).runner(), look_for_a_client)
    assert out.startswith("none:")

    @task
    def raw(x):  # what `.fn.__wrapped__` of an AI task is: its body without admission
        return x

    @flow(task_runner=DaskTaskRunner(address=gpu_cluster.scheduler_address))
    def through_prefect_dask():
        return raw.submit(1).result()

    with pytest.raises(Exception) as refused:
        through_prefect_dask()
    assert "TLS" in str(refused.value) or isinstance(refused.value, (OSError, AssertionError)), refused.value


def test_a_workers_certificate_does_not_make_a_dask_client(gpu_cluster, cluster_tls, dask_client, quick_connect):
    """A body reads its worker's TLS key (its worker's user can): as a client it is refused, and it cannot ask a
    worker to run code or hand over data either (dask_gpu.gate)."""
    import asyncio

    from distributed.core import rpc
    from distributed.protocol.pickle import dumps
    from distributed.security import Security

    d = cluster_tls.directory
    stolen = Security(tls_ca_file=str(d / "ca.pem"), tls_client_cert=str(d / "cluster.pem"),
                      tls_client_key=str(d / "cluster.key"), require_encryption=True)
    with pytest.raises(Exception):
        connect_client(gpu_cluster.scheduler_address, timeout=5, security=stolen)
    worker = next(iter(workers_info(dask_client)))

    async def ask(op: str, **msg):
        remote = rpc(worker, connection_args=stolen.get_connection_args("client"))
        try:
            return await getattr(remote, op)(**msg)
        finally:
            await remote.close_rpc()

    for op, msg in (("run", {"function": dumps(lambda: "owned")}), ("get_data", {"keys": ["x"]}),
                    ("plugin-add", {"plugin": dumps(object())})):
        with pytest.raises(Exception, match="refuses"):
            asyncio.run(ask(op.replace("-", "_") if op != "plugin-add" else op, **msg))


def test_a_valid_ticket_runs_once_for_the_whole_cluster(dask_client, signer):
    body = body_of(answer)
    ticket = ticket_for(signer, body)
    out = run(dask_client, ticket, body, "gpu-worker-0")
    assert out.ok and cloudpickle.loads(out.value) == 42 and out.run.worker
    for worker in ("gpu-worker-1", "gpu-worker-0"):  # read off the scheduler, replayed on the other worker, or again
        with pytest.raises(TicketRejected, match="was already used"):
            run(dask_client, ticket, body, worker)


def test_forged_altered_untrusted_expired_and_missing_tickets_are_refused(dask_client, signer):
    body = body_of(answer)
    good = ticket_for(signer, body)
    wider = GPURequest(gpus=2, gpu_type="H100")
    cases = [
        (None, body, "no ticket"),
        (ticket_for(TicketSigner.generate(), body), body, "was not started to trust"),
        (good.model_copy(update={"signature": "00" * 64}), body, "bad signature"),
        (good.model_copy(update={"request": wider}), body, "bad signature"),
        (good.model_copy(update={"expires_at": good.expires_at + 86400}), body, "bad signature"),
        (good.model_copy(update={"code_digest": code_digest(something_else)}), body, "bad signature"),
        (good, body_of(something_else), "issued for other bytes"),
        (ticket_for(signer, body, ttl_seconds=-1), body, "expired"),
    ]
    for ticket, payload, match in cases:
        with pytest.raises(TicketRejected, match=match):
            run(dask_client, ticket, payload)
    assert run(dask_client, good, body).ok  # none of the refusals used it up


def test_a_body_whose_code_is_not_the_admitted_code_is_refused_in_its_process(dask_client, signer):
    """The ticket was issued for `answer`'s code; the bytes (which it does bind) unpickle to another function."""
    body = body_of(something_else)
    out = run(dask_client, ticket_for(signer, body, fn=answer), body)
    assert not out.ok and "is not the code that was admitted" in out.error_message
