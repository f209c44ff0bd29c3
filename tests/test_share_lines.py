"""Waiting fractions in the queue plugin, driven by hand (no Dask): a pass over the queue costs what it starts and one
look per shape, not one per waiting fraction, and fractions still start oldest first across shapes."""

from __future__ import annotations

import asyncio

from dask_gpu.scheduler.queue import GPUQueuePlugin
from tests.test_policy_books import Scheduler, SpyPolicy, check_books


class CountingDict(dict):
    """A dict that counts the lookups made on it (what a pass over the queue reads of its waiting runs)."""

    lookups = 0

    def __contains__(self, key):
        CountingDict.lookups += 1
        return super().__contains__(key)

    def __getitem__(self, key):
        CountingDict.lookups += 1
        return super().__getitem__(key)

    def get(self, key, default=None):
        CountingDict.lookups += 1
        return super().get(key, default)


async def _plugin(share: float = 0.25) -> GPUQueuePlugin:
    """A queue of one worker with two H100s, both full of fractions of `share` (r0, r1, ...) of tenant a."""
    plugin = GPUQueuePlugin(SpyPolicy())
    await plugin.start(Scheduler(["tcp://w0"]))
    await asyncio.sleep(0)
    await asyncio.gather(*[asyncio.ensure_future(plugin.place(f"r{i}", tenant="a", gpus=share, estimate=60.0))
                           for i in range(int(2 / share))])
    return plugin


def _end(plugin: GPUQueuePlugin, keys: list[str]) -> None:
    for key in keys:
        plugin.leave(key)


def test_a_pass_over_thousands_of_waiting_fractions_reads_what_it_starts_not_what_waits():
    async def scenario():
        plugin = await _plugin()
        waiting = [asyncio.ensure_future(plugin.place(f"w{i}", tenant="a", gpus=0.25, estimate=60.0))
                   for i in range(5000)]
        await asyncio.sleep(0)
        assert len(plugin.waiters) == 5000
        plugin.waiters = CountingDict(plugin.waiters)
        CountingDict.lookups = 0
        plugin._dispatch()  # nothing freed: the line's oldest finds no room, and the pass stops there
        assert CountingDict.lookups < 20, CountingDict.lookups
        plugin.leave("r0")  # one quarter freed: the oldest waiting fraction takes it
        CountingDict.lookups = 0
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert CountingDict.lookups < 40, CountingDict.lookups
        assert plugin.keys["w0"] in plugin.fraction_runs and plugin.keys["w1"] not in plugin.fraction_runs
        assert len(plugin.waiters) == 4999
        check_books(plugin)
        _end(plugin, [f"w{i}" for i in range(5000)] + [f"r{i}" for i in range(1, 8)])
        await asyncio.gather(*waiting, return_exceptions=True)
        assert plugin.policy.runs == {} and plugin.share_lines == {}

    asyncio.run(scenario())


def test_waiting_fractions_of_two_shapes_start_oldest_first_and_each_shape_stops_at_its_first_miss():
    async def scenario():
        plugin = await _plugin(share=0.5)  # both devices full: two halves each
        order = ["h1", "q1", "h2", "q2", "q3"]  # halves and quarters, alternating as they entered
        waiting = {k: asyncio.ensure_future(plugin.place(k, tenant="b", gpus=0.5 if k[0] == "h" else 0.25,
                                                         estimate=60.0)) for k in order}
        await asyncio.sleep(0)
        assert len(plugin.share_lines) == 2
        plugin.leave("r0")
        plugin.leave("r1")  # device 0 empties: a whole device of room
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        started = {k for k in order if plugin.keys[k] in plugin.fraction_runs}
        # h1 (0.5) then q1 (0.25): 0.75 taken; h2 no longer fits, so no half after it is looked at, but q2 still
        # fits (1.0); q3 waits with h2.
        assert started == {"h1", "q1", "q2"}, started
        assert all(plugin.fractions[plugin.keys[k]][1] is plugin.fractions[plugin.keys["h1"]][1] for k in started)
        check_books(plugin)
        _end(plugin, [*order, "r2", "r3"])
        await asyncio.gather(*waiting.values(), return_exceptions=True)
        assert plugin.policy.runs == {}

    asyncio.run(scenario())



def test_a_pass_over_thousands_of_shapes_costs_one_look_per_shape_and_per_start():
    """Every memory size a tenant asks is a shape of its own: the pass must not look at every shape again after
    each start or miss (2,000 shapes would cost 4 million looks, seconds of the scheduler's event loop)."""
    async def scenario():
        plugin = await _plugin()
        waiting = [asyncio.ensure_future(plugin.place(f"w{i}", tenant="b", gpus=0.25, estimate=60.0,
                                                      memory=1.0 + i * 1e-6)) for i in range(2000)]
        await asyncio.sleep(0)
        assert len(plugin.share_lines) == 2000
        looks = [0]
        head = plugin._head

        def counted(shape):
            looks[0] += 1
            return head(shape)

        plugin._head = counted
        plugin.leave("r0")  # a quarter of device 0 frees: the oldest shape that fits takes it
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert plugin.keys["w0"] in plugin.fraction_runs
        assert looks[0] <= 2 * 2000 + 10, looks[0]
        check_books(plugin)
        _end(plugin, [f"w{i}" for i in range(2000)] + [f"r{i}" for i in range(1, 8)])
        await asyncio.gather(*waiting, return_exceptions=True)

    asyncio.run(scenario())


def test_runs_that_enter_and_leave_behind_one_that_waits_do_not_pile_up_in_its_line():
    async def scenario():
        plugin = await _plugin()
        first = asyncio.ensure_future(plugin.place("first", tenant="b", gpus=0.25, estimate=60.0))
        await asyncio.sleep(0)
        for i in range(5000):  # each waits behind `first`, then its client gives up on it
            f = asyncio.ensure_future(plugin.place(f"w{i}", tenant="b", gpus=0.25, estimate=60.0))
            await asyncio.sleep(0)
            plugin.leave(f"w{i}")
            await f
        (line,) = plugin.share_lines.values()
        assert len(line) <= 2 * 64, len(line)
        assert plugin.keys["first"] in plugin.waiters and plugin.keys["first"] in line
        plugin.leave("r0")
        await first  # still first in its line: it takes the quarter freed
        assert plugin.keys["first"] in plugin.fraction_runs
        check_books(plugin)
        _end(plugin, ["first", *[f"r{i}" for i in range(1, 8)]])

    asyncio.run(scenario())
