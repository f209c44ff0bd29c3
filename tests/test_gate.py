"""The gate's lists cover every op a real scheduler, worker and nanny answer: a new op is refused until classified."""

from __future__ import annotations

import asyncio

import pytest

from dask_gpu import gate
from dask_gpu.security import ClusterTLS


def _live_tables(tmp_path) -> dict[str, tuple[set[str], set[str], object, object]]:
    """kind -> (handler ops, stream ops, handlers table, server) of a TLS scheduler, worker and nanny as the product
    starts them (preloads, plugins and their handlers included)."""
    from distributed import Nanny, Scheduler, Worker

    tls = ClusterTLS.create(tmp_path / "tls")

    async def main() -> dict:
        async with Scheduler(protocol="tls", security=tls.security("scheduler"), dashboard_address=":0",
                             host="127.0.0.1", preload=["dask_gpu.scheduler.preload"]) as s:
            async with Worker(s.address, security=tls.security("cluster"), host="127.0.0.1",
                              preload=["dask_gpu.worker.preload"]) as w:
                nanny = Nanny(s.address, security=tls.security("cluster"), host="127.0.0.1")
                gate.gate_nanny(nanny)  # what dask_gpu.worker.nanny_preload does when the nanny starts
                return {"scheduler": (set(s.handlers), set(s.stream_handlers), s.handlers, s),
                        "worker": (set(w.handlers), set(w.stream_handlers), w.handlers, w),
                        "nanny": (set(nanny.handlers), set(getattr(nanny, "stream_handlers", {})), nanny.handlers,
                                  nanny)}

    return asyncio.run(main())


def test_every_live_op_of_scheduler_worker_and_nanny_is_classified_and_gated(tmp_path):
    live = _live_tables(tmp_path)
    for kind, (ops, stream_ops, handlers, _) in live.items():
        table, streams = gate.TABLES[kind]
        unknown = sorted(ops - set(table))
        assert not unknown, (f"the {kind} answers ops dask_gpu.gate does not classify: {unknown}. Decide which role "
                             "may ask for each (a new `distributed` release?) and add it to the gate's lists")
        unknown_stream = sorted(stream_ops - streams)
        assert not unknown_stream, f"the {kind}'s stream takes ops dask_gpu.gate does not classify: {unknown_stream}"
        assert isinstance(handlers, gate.GatedHandlers), f"the {kind}'s handlers are not gated"
        assert all(getattr(h, "_gated", False) for h in handlers.values())


def test_a_worker_certificate_may_do_only_what_a_worker_needs():
    worker_ops = {op for op, roles in gate.SCHEDULER_OPS.items() if gate.CLUSTER in roles}
    assert worker_ops == {"register-worker", "heartbeat_worker", "register_nanny", "who_has", "gpu_ticket_redeem",
                          "gpu_gang_meet"}
    assert not {op for op, roles in gate.WORKER_OPS.items() if gate.CLUSTER in roles}
    assert {op for op, roles in gate.NANNY_OPS.items() if gate.CLUSTER in roles} == {"close_gracefully"}
    assert gate.SCHEDULER_OPS["feed"] == gate.DENIED
    assert not gate.SCHEDULER_WORKER_STREAM & {"update-graph", "client-desires-keys", "cancel-keys", "update-data"}


def test_an_op_added_later_is_refused_to_every_certificate_even_the_control_planes():
    class Comm:
        extra_info = {"peercert": {"subject": ((("commonName", gate.CLIENT),),)}}

    handlers = gate.GatedHandlers({}, gate.SCHEDULER_OPS, "the scheduler")
    handlers["brand_new_op"] = lambda: "ran"  # what a plugin, or a later distributed, adds after the gate
    handlers["identity"] = lambda: "me"
    with pytest.raises(gate.GateRefused, match="does not know this op.*Fix: classify it"):
        asyncio.run(handlers["brand_new_op"](Comm()))
    assert asyncio.run(handlers["identity"](Comm())) == "me"
    Comm.extra_info = {"peercert": {"subject": ((("commonName", gate.CLUSTER),),)}}
    with pytest.raises(PermissionError, match="only aisched-client may ask for it"):
        asyncio.run(handlers["identity"](Comm()))


def test_a_workers_stream_carries_only_its_own_worker_messages():
    check = gate._stream_check("the scheduler", gate.SCHEDULER_WORKER_STREAM, "tls://w1:1", lambda: {"tls://w2:2"})
    assert check({"op": "task-finished", "key": "k"})
    assert check({"op": "log-event", "topic": "aisched-placed", "msg": {}})
    assert not check({"op": "update-graph", "graph_header": {}})  # submitting tasks is a client's op
    assert not check({"op": "task-finished", "key": "k", "worker": "tls://w2:2"})  # another worker's result
    assert not check({"op": "log-event", "topic": "all", "msg": {"action": "remove-worker"}})
    assert not check({"op": "log-event", "topic": ["x", "tls://w2:2"], "msg": {}})


def test_a_registered_workers_stream_cannot_submit_tasks_or_forge_events(tmp_path, caplog):
    """A worker (or a body holding its certificate) registered at the scheduler sends a client's `update-graph` and
    a `remove-worker` event on its stream: the scheduler drops both, says so, and keeps the worker."""
    import logging

    from distributed import Scheduler, Worker

    tls = ClusterTLS.create(tmp_path / "tls")
    caplog.set_level(logging.WARNING, logger="distributed.dask_gpu.gate")

    async def main() -> list[str]:
        async with Scheduler(protocol="tls", security=tls.security("scheduler"), dashboard_address=":0",
                             host="127.0.0.1", preload=["dask_gpu.scheduler.preload"]) as s:
            async with Worker(s.address, security=tls.security("cluster"), host="127.0.0.1") as w:
                w.batched_stream.send({"op": "update-graph", "graph_header": {}, "graph_frames": [],
                                       "keys": ["owned"], "span_metadata": {}})
                w.batched_stream.send({"op": "log-event", "topic": "all",
                                       "msg": {"action": "remove-worker", "worker": w.address}})
                w.batched_stream.send({"op": "keep-alive"})
                for _ in range(200):
                    dropped = [r.getMessage() for r in caplog.records if "drops" in r.getMessage()]
                    if len(dropped) >= 2:
                        break
                    await asyncio.sleep(0.02)
                assert w.address in s.workers and "owned" not in s.tasks
                return dropped

    dropped = asyncio.run(main())
    assert any("'update-graph'" in m and "not a message this stream carries" in m for m in dropped), dropped
    assert any("topic 'all'" in m for m in dropped), dropped
