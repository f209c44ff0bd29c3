"""Gang runs: a run wider than every host runs on whole hosts, all at once or not at all (policy and queue plugin)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from dask_gpu.scheduler.queue import GPUQueuePlugin
from dask_gpu.sim.policies import ClusterState, EasyBackfill, FairShare, Fifo, Job, PlainDask, Running, reservation
from dask_gpu.sim.simulator import simulate


def job(i, gpus, submit=0.0, duration=10.0, tenant="a"):
    return Job(id=i, tenant=tenant, gpus=gpus, submit=submit, estimate=duration)


def run(policy, jobs, hosts=2, gpus=4):
    return simulate(jobs, {j.id: j.estimate for j in jobs}, policy, hosts, gpus)


def test_a_gang_waits_for_whole_hosts_and_holds_them_all_in_every_policy():
    # 2 hosts x 4: a 1-GPU run on host 0 for 10 s; a 6-GPU gang needs both hosts whole; it starts at 10 s.
    jobs = [job(0, 1, duration=10.0), job(1, 6, submit=1.0, duration=5.0), job(2, 1, submit=2.0, duration=1.0)]
    for policy in (PlainDask(2), Fifo(), EasyBackfill(), FairShare(headroom=0)):
        out = run(policy, jobs)
        assert out.started[1] == 10.0, policy.name
        gang_busy = [r for t, r, _ in out.timeline if 10.0 <= t < 15.0]
        assert all(sum(r.values()) <= 8 for r in gang_busy)
    assert run(EasyBackfill(), jobs).started[2] == 2.0  # ends at 3 s, before the gang's reservation: backfilled
    assert run(Fifo(), jobs).started[2] == 15.0  # behind the gang


def test_a_gang_reservation_is_the_time_enough_hosts_are_idle():
    state = ClusterState(free=[0, 3, 4], size=[4, 4, 4],
                         running=[Running(job(0, 4, duration=30.0), 0, 0.0), Running(job(1, 1, duration=5.0), 1, 0.0)])
    assert reservation(job(9, 8), 0.0, state) == (5.0, {2: 0, 1: 0})
    assert reservation(job(9, 12), 0.0, state) == (30.0, {2: 0, 1: 0, 0: 0})


def test_backfill_does_not_delay_a_gang():
    # A 6-GPU gang waits for host 0 (busy 10 s); a 1-GPU 50 s job would hold host 1 past that: it must wait.
    jobs = [job(0, 4, duration=10.0), job(1, 6, submit=1.0, duration=5.0), job(2, 1, submit=2.0, duration=50.0)]
    for policy in (EasyBackfill(), FairShare(headroom=0)):
        s = run(policy, jobs).started
        assert s[1] == 10.0 and s[2] >= 10.0, policy.name


class _Scheduler:
    """What the plugin reads of a Dask scheduler: its workers' GPU resources and names."""

    def __init__(self, gpus: dict[str, int]) -> None:
        self.workers = {a: SimpleNamespace(resources={"GPU": g}, name=a) for a, g in gpus.items()}
        self.handlers: dict = {}


def test_the_queue_plugin_places_a_gang_on_whole_workers_and_frees_them_at_leave():
    async def scenario():
        plugin = GPUQueuePlugin(FairShare(headroom=0))
        await plugin.start(_Scheduler({"tcp://w0": 2, "tcp://w1": 2, "tcp://w2": 2}))
        small = asyncio.ensure_future(plugin.run("small", tenant="a", gpus=1, estimate=60.0))
        assert await small == "tcp://w0"  # one worker: an address, as before
        gang = asyncio.ensure_future(plugin.run("gang", tenant="b", gpus=4, estimate=60.0))
        assert sorted(await gang) == ["tcp://w1", "tcp://w2"]  # two whole workers, all at once
        assert plugin.status()["free"] == {"tcp://w0": 1, "tcp://w1": 0, "tcp://w2": 0}
        wide = asyncio.ensure_future(plugin.run("wide", tenant="c", gpus=6, estimate=60.0))
        await asyncio.sleep(0)
        assert not wide.done()  # needs all three workers whole: waits
        runs = plugin.status(runs=True)["runs"]
        assert [r["state"] for r in runs] == ["running", "running", "queued"] and len(runs[1]["workers"]) == 2
        plugin.leave("small")
        plugin.leave("gang")
        assert sorted(await wide) == ["tcp://w0", "tcp://w1", "tcp://w2"]
        plugin.remove_worker(plugin.scheduler, "tcp://w1")  # a gang's worker dies: the others are free again
        assert plugin.status()["free"] == {"tcp://w0": 2, "tcp://w1": 0, "tcp://w2": 2}

    asyncio.run(scenario())


def test_fractions_share_an_open_device_at_once_and_only_a_fresh_device_waits_in_the_policy():
    """The plugin's device books: a fraction starts on a shared device with room (best fit) without the policy; one that
    needs a fresh device is a one-GPU run for the policy; the device counts as busy until its last fraction leaves."""
    from dask_gpu.scheduler.queue import Device

    async def scenario():
        plugin = GPUQueuePlugin(FairShare(headroom=0))
        await plugin.start(_Scheduler({"tcp://w0": 2}))
        plugin.devices["tcp://w0"] = [Device("0", "A10", 24.0), Device("1", "A10", 24.0)]
        first = await plugin.place("q1", tenant="a", gpus=0.5, estimate=10.0)
        assert first["devices"] == [["0"]] and plugin.status()["free"] == {"tcp://w0": 1}  # it opened device 0
        second = await plugin.place("q2", tenant="a", gpus=0.25, estimate=10.0)
        assert second["devices"] == [["0"]]  # room on device 0: no policy, no fresh device
        whole = await plugin.place("w", tenant="b", gpus=1, estimate=10.0)
        assert whole["devices"] == [["1"]]  # the queue chose the idle device for the whole run
        third = asyncio.ensure_future(plugin.place("q3", tenant="a", gpus=0.5, estimate=10.0))
        await asyncio.sleep(0)
        assert not third.done()  # device 0 has 0.25 left, device 1 is held whole: it waits
        status = plugin.status(runs=True)
        assert status["fractions"] == 2 and sorted(r["gpus"] for r in status["runs"] if r["state"] == "running") == [0.25, 0.5, 1]
        plugin.leave("q1")  # device 0 has room again: the waiting fraction takes it, without the policy
        assert (await third)["devices"] == [["0"]]
        plugin.leave("q2")
        plugin.leave("q3")
        assert plugin.status()["free"] == {"tcp://w0": 1}  # device 0 is free again once its last fraction left
        plugin.leave("w")
        assert plugin.status()["free"] == {"tcp://w0": 2} and plugin.status()["devices"] == {"tcp://w0": {"0": 0.0, "1": 0.0}}

    asyncio.run(scenario())


def test_fractions_that_enter_in_one_burst_share_the_device_the_first_of_them_opens():
    """Two quarter-GPU runs enter together once the open device is full: the first opens a fresh device and the
    second shares it, not a third device (test_fractions_queue saw [4, 1, 1] across three A10s once)."""
    from dask_gpu.scheduler.queue import Device

    async def scenario():
        plugin = GPUQueuePlugin(FairShare(headroom=0))
        await plugin.start(_Scheduler({"tcp://w0": 3}))
        plugin.devices["tcp://w0"] = [Device(str(i), "A10", 24.0) for i in range(3)]
        first = [await plugin.place(f"q{i}", tenant="a", gpus=0.25, estimate=10.0) for i in range(4)]
        assert {tuple(map(tuple, f["devices"])) for f in first} == {(("0",),)}  # device 0 full
        burst = [asyncio.ensure_future(plugin.place(f"b{i}", tenant="a", gpus=0.25, estimate=10.0)) for i in range(2)]
        placed = await asyncio.gather(*burst)
        assert placed[0]["devices"] == placed[1]["devices"] != [["0"]], placed
        assert plugin.status()["free"] == {"tcp://w0": 1}  # two devices busy, one left whole
        for key in ["q0", "q1", "q2", "q3", "b0", "b1"]:
            plugin.leave(key)
        assert plugin.status()["free"] == {"tcp://w0": 3}

    asyncio.run(scenario())

