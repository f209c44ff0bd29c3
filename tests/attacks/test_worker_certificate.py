"""Attack 7, the worker's certificate: a body that read its worker's `cluster.key` asks the cluster to run its code.

Before: Dask's `feed` op was not gated (it unpickles a setup function and runs it on the scheduler), nannies were not
gated at all (their `run` executed the body's code), and `get_cluster_state`, `dump_cluster_state_to_url`,
`terminate`, `retire_workers`, `unregister`, `set_resources`, `log_event`, `gpu_queue_place` and `gpu_limit_cancel`
answered a worker's certificate. Now the gate is default-deny on the scheduler, every worker and every nanny, and a
worker's certificate keeps only what a worker needs (dask_gpu.gate).
"""

from __future__ import annotations

import asyncio

import pytest
from distributed.core import rpc
from distributed.protocol.pickle import dumps
from distributed.security import Security
from tests.helpers import workers_info


@pytest.fixture(scope="module")
def stolen(cluster_tls) -> Security:
    d = cluster_tls.directory
    return Security(tls_ca_file=str(d / "ca.pem"), tls_client_cert=str(d / "cluster.pem"),
                    tls_client_key=str(d / "cluster.key"), require_encryption=True)


def ask(_where: str, _security: Security, _op: str, **msg):
    async def main():
        remote = rpc(_where, connection_args=_security.get_connection_args("client"))
        try:
            return await getattr(remote, _op)(**msg)
        finally:
            await remote.close_rpc()

    return asyncio.run(main())


def _owned(path: str) -> str:
    open(path, "w").write("owned")
    return "owned"


def test_the_worker_certificate_opens_nothing_that_runs_code_reads_tasks_or_changes_others_on_the_scheduler(
        gpu_cluster, dask_client, stolen, tmp_path):
    scheduler = gpu_cluster.scheduler_address
    workers = list(workers_info(dask_client))
    proof = tmp_path / "ran"
    attempts = {
        "feed": {"function": dumps(lambda dask_scheduler: _owned(str(proof))), "interval": "10ms"},
        "get_cluster_state": {"exclude": []},
        "dump_cluster_state_to_url": {"url": str(tmp_path / "state"), "exclude": [], "format": "msgpack"},
        "get_runspec": {"key": "x"},
        "terminate": {},
        "retire_workers": {"workers": workers[:1]},
        "unregister": {"address": workers[0], "stimulus_id": "attack"},
        "set_resources": {"worker": workers[0], "resources": {"GPU": 99}},
        "log_event": {"topic": "all", "msg": {"action": "remove-worker", "worker": workers[0]}},
        "gpu_queue_place": {"key": "x", "tenant": "t"},
        "gpu_limit_cancel": {"name": "m", "client": "c", "key": "k"},
        "run_function": {"function": dumps(lambda: _owned(str(proof)))},
        "broadcast": {"msg": {"op": "run", "function": dumps(lambda: _owned(str(proof)))}},
        "register_worker_plugin": {"plugin": dumps(object()), "name": "x"},
    }
    for op, msg in attempts.items():
        with pytest.raises(PermissionError, match="refuses"):
            ask(scheduler, stolen, op.replace("-", "_"), **msg)
    assert not proof.exists()
    assert sorted(workers_info(dask_client)) == sorted(workers)  # nobody was removed
    assert dask_client.submit(lambda: 1, pure=False).result(timeout=30) == 1  # the scheduler still runs


def test_a_nanny_refuses_the_worker_certificate(dask_client, stolen, tmp_path):
    proof = tmp_path / "ran"
    nannies = [w["nanny"] for w in workers_info(dask_client).values()]
    assert len(nannies) == 3 and all(nannies)
    for nanny in nannies:
        for op, msg in (("run", {"function": dumps(lambda: _owned(str(proof)))}), ("kill", {}), ("restart", {}),
                        ("terminate", {}), ("plugin_add", {"plugin": dumps(object()), "name": "x"})):
            with pytest.raises(PermissionError, match="refuses"):
                ask(nanny, stolen, op, **msg)
    assert not proof.exists()
    # The control plane's own broadcast to nannies still goes through (the scheduler's certificate relays it).
    assert len(dask_client.run(lambda: "ok", nanny=True)) == 3


def test_a_worker_refuses_the_worker_certificate(dask_client, stolen, tmp_path):
    proof = tmp_path / "ran"
    for worker in workers_info(dask_client):
        for op, msg in (("run", {"function": dumps(lambda: _owned(str(proof)))}), ("get_data", {"keys": ["x"]}),
                        ("gpu_stop", {"keys": ["x"]}), ("connection_stream", {})):
            with pytest.raises(PermissionError, match="refuses"):
                ask(worker, stolen, op, **msg)
    assert not proof.exists()
