"""Single use that holds against a scheduler whose memory was altered: a ticket names where it runs, and each worker
keeps what it ran (the scheduler's registry is one check, not the only one).

The scheduler's memory is reachable by whoever holds its process; these checks read only the signed ticket and
the worker's own memory (which an isolated body cannot reach: tests/test_isolation.py)."""

from __future__ import annotations

import time
import types

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dask_gpu import GPURequest
from dask_gpu.worker.life import _redeem_here
from dask_gpu.tickets import TicketRejected, TicketSigner, verify_signature


def _ticket(**kw):
    signer = TicketSigner(Ed25519PrivateKey.generate())
    ticket = signer.issue(run="adm/attempt", payload_digest="p" * 64, code_digest="c" * 64,
                          request=GPURequest(gpus=1), ttl_seconds=60, lease_seconds=30, **kw)
    return signer, ticket


def test_a_ticket_placed_on_one_worker_is_refused_on_another():
    signer, ticket = _ticket(workers=("tls://10.0.0.1:4000",))
    ticket.check_worker("tls://10.0.0.1:4000", 0)
    with pytest.raises(TicketRejected, match="was issued for tls://10.0.0.1:4000"):
        ticket.check_worker("tls://10.0.0.2:4000", 0, "gpu-b")
    _, by_name = _ticket(workers=("gpu-a",))  # the queue off: Dask chooses among the named workers
    by_name.check_worker("tls://10.0.0.9:4000", 0, "gpu-a")
    with pytest.raises(TicketRejected):
        by_name.check_worker("tls://10.0.0.9:4000", 0, "gpu-b")
    # The binding is signed: a ticket rewritten to name another worker no longer verifies.
    forged = ticket.model_copy(update={"workers": ("tls://10.0.0.2:4000",)})
    with pytest.raises(TicketRejected):
        verify_signature(forged, {signer.key_id: signer.public_key})


def test_a_gang_member_runs_only_on_its_own_worker():
    _, ticket = _ticket(workers=("tls://a:1", "tls://b:1"), hosts=2, shares=(1, 1))
    ticket.check_worker("tls://b:1", 1)
    with pytest.raises(TicketRejected):
        ticket.check_worker("tls://a:1", 1)


def test_a_worker_runs_a_ticket_once_whatever_the_scheduler_remembers():
    _, ticket = _ticket()
    plugin = types.SimpleNamespace()
    _redeem_here(plugin, ticket, 0)  # the scheduler's registry said "fresh" both times (its memory was altered)
    with pytest.raises(TicketRejected, match="already used on this worker"):
        _redeem_here(plugin, ticket, 0)
    _redeem_here(plugin, ticket, 1)  # another member of a gang is its own redemption


def test_the_workers_memory_of_used_tickets_forgets_them_once_they_expire():
    _, ticket = _ticket()
    plugin = types.SimpleNamespace()
    _redeem_here(plugin, ticket.model_copy(update={"expires_at": time.time() - 1}), 0)
    _redeem_here(plugin, ticket, 0)  # the expired entry was pruned (an expired ticket fails its signature check first)
    assert list(plugin._redeemed_here) == [(ticket.id, 0)]


def test_runs_redeeming_at_once_in_many_threads_each_run_once():
    """A worker runs its tasks in many threads: the check and the mark of a redemption are one step (a
    .map() of 10,000 found the memory changing under a check: 'dictionary changed size during iteration')."""
    import threading

    plugin = types.SimpleNamespace()
    tickets = [_ticket()[1] for _ in range(50)]
    outcomes: list[str] = []
    start = threading.Barrier(8)

    def redeem_all() -> None:
        start.wait()
        for t in tickets:
            try:
                _redeem_here(plugin, t, 0)
                outcomes.append("ran")
            except TicketRejected:
                outcomes.append("refused")

    threads = [threading.Thread(target=redeem_all) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert outcomes.count("ran") == len(tickets) and outcomes.count("refused") == 7 * len(tickets)


def test_the_schedulers_registry_refuses_a_second_redemption_and_forgets_each_ticket_when_it_expires(monkeypatch):
    """The registry forgets a redemption as its ticket expires, earliest first, whatever else it holds: a map of
    10,000 shards keeps that many unexpired tickets, and a redemption no longer looks at each of them (before, every
    redemption past 1,024 rebuilt the registry's tables: the scheduler's largest cost a shard in a 5,000-shard map)."""
    from dask_gpu.tickets import TicketRegistry

    import dask_gpu.tickets

    now = 1_000_000.0
    clock = types.SimpleNamespace(time=lambda: now)
    monkeypatch.setattr(dask_gpu.tickets, "time", clock)  # the registry's clock, moved by the test
    registry = TicketRegistry()
    assert registry.redeem("live", now + 600, member=0, hosts=2) and registry.redeem("live", now + 600, member=1, hosts=2)
    assert not registry.redeem("live", now + 600, member=1, hosts=2)  # twice: refused, and the refusal kept
    assert registry.redeem("soon", now + 0.05, worker="w1")
    assert not registry.redeem("soon", now + 0.05, worker="w2")
    assert not registry.redeem("never", now + 0.05, member=3, hosts=1)  # no such member: refused, nothing redeemed
    assert [m["member"] for m in registry.where("live")["members"]] == [0, 1]
    assert [r["worker"] for r in registry.where("soon")["refused"]] == ["w2"]
    now += 1  # past the short tickets' expiry
    assert registry.redeem("next", now + 600)  # a redemption forgets what expired before it
    assert registry.where("soon") == {"members": [], "refused": []} and registry.where("never")["refused"] == []
    assert len(registry.where("live")["members"]) == 2 and len(registry.where("live")["refused"]) == 1
    assert set(registry._used) == {("live", 0), ("live", 1), ("next", 0)}
    assert not registry.redeem("live", now + 600, member=0, hosts=2)  # still refused while it lives
