"""Every run through the policy's books: whole runs, fractions (those that open a device and those that join one),
gangs, warm-less preemptions and re-entries, worker deaths and clients that leave, driven at random through the
queue plugin by hand (no Dask), with the policy's books checked against the queue's after every step."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from dask_gpu.inventory import GPUDevice, WorkerInventory
from dask_gpu.policies.finish_time_fair import FinishTimeFair
from dask_gpu.scheduler.queue import GPUQueuePlugin


class SpyPolicy(FinishTimeFair):
    """FinishTimeFair that records, per job id, what it was told and what it started."""

    def __init__(self) -> None:
        super().__init__(half_life=7 * 86400.0)
        self.events: dict[int, list[str]] = {}

    def _note(self, jobs, what: str) -> None:
        for job in jobs:
            self.events.setdefault(job.id, []).append(what)

    def submit(self, job, state) -> None:
        self._note([job], "submit")
        super().submit(job, state)

    def schedule(self, now, state):
        starts = super().schedule(now, state)
        self._note([s.job for s in starts], "start")
        return starts

    def started(self, jobs, now) -> None:
        self._note(jobs, "start")
        super().started(jobs, now)

    def withdraw(self, jobs) -> None:
        self._note(jobs, "withdraw")
        super().withdraw(jobs)

    def finish(self, jobs, now=None) -> None:
        self._note(jobs, "finish")
        super().finish(jobs, now)


def _inventory(address: str) -> dict:
    devices = tuple(GPUDevice(index=i, uuid=f"{address}-{i}", name="H100", gpu_type="H100", memory_gb=80.0)
                    for i in range(2))
    return {"inventory": WorkerInventory(devices=devices, host=address).model_dump(mode="json")}


class Scheduler:
    def __init__(self, addresses: list[str]) -> None:
        self.workers = {a: SimpleNamespace(resources={"GPU": 2}, name=a) for a in addresses}
        self.handlers: dict = {}
        self.stopped: list[str] = []

    async def broadcast(self, msg, workers, on_error="raise"):
        if msg["op"] == "gpu_inventory":
            return {w: _inventory(w) for w in workers if w in self.workers}
        if msg["op"] == "gpu_stop":
            self.stopped.extend(msg["keys"])
        return {}


def check_books(plugin: GPUQueuePlugin) -> None:
    """The policy's books say what the queue holds: who waits, who runs (whole, fraction or preempted and not yet
    entered again), and nothing else."""
    p = plugin.policy
    waiting = set(plugin.waiters)
    started = set(plugin.running) | set(plugin.fraction_runs) | set(plugin.requeue)
    assert p.waiting() == len(waiting)
    assert sum(v[0] for v in p.pending.values()) == len(waiting)
    assert set(p.runs) == started, (set(p.runs) ^ started)
    jobs = {j: job for j, (_, job) in plugin.waiters.items()}
    jobs.update({j: r.job for j, (r, _) in plugin.running.items()})
    jobs.update({j: v[3] for j, v in plugin.requeue.items()})
    preemptible = {j for j in started if j in jobs and jobs[j].preemptible}
    assert set(p.alone) == waiting | preemptible
    assert set(p.done_by) == preemptible
    assert set(p.claims) <= waiting
    assert set(p.estimates.view) == waiting | started



def check_events(events: dict[int, list[str]]) -> None:
    """Each run: submitted, started, then either finished, or (preempted) submitted again; it ends exactly once:
    finished after a start, or withdrawn while it waits (never started, or entered again after a preemption and
    abandoned)."""
    for jid, seq in events.items():
        assert seq[0] == "submit", (jid, seq)
        assert seq.count("finish") + seq.count("withdraw") == 1 and seq[-1] in ("finish", "withdraw"), (jid, seq)
        body = seq[:-1]  # submit (start submit)* [start]: alternating, a start always after a submit
        assert all(x == ("submit" if i % 2 == 0 else "start") for i, x in enumerate(body)), (jid, seq)
        assert (seq[-1] == "finish") == (body[-1] == "start"), (jid, seq)


async def drive(seed: int, steps: int) -> SpyPolicy:
    rng = random.Random(seed)
    addresses = [f"tcp://w{i}" for i in range(4)]
    scheduler = Scheduler(addresses)
    policy = SpyPolicy()
    plugin = GPUQueuePlugin(policy)
    await plugin.start(scheduler)
    await asyncio.sleep(0)
    tasks: dict[str, asyncio.Future] = {}  # key -> its place() call
    asked: dict[str, dict] = {}  # key -> its place() arguments
    n = 0
    spare = 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.45:  # a new run: whole, fraction, gang or preemptible
            n += 1
            key = f"k{n}"
            kind = rng.choice(["whole", "whole", "fraction", "fraction", "gang", "preemptible"])
            args = dict(tenant=rng.choice("abc"), estimate=rng.choice([10.0, 600.0, 3600.0]),
                        client=rng.choice(["c1", "c2"]), priority=0)
            if kind == "whole":
                args.update(gpus=rng.choice([1, 2]))
            elif kind == "fraction":
                args.update(gpus=rng.choice([0.25, 0.5]))
            elif kind == "gang":
                args.update(gpus=4, width=2)
            else:
                args.update(gpus=1, preemptible=True, task=f"task-{key}")
            asked[key] = args
            tasks[key] = asyncio.ensure_future(plugin.place(key, **args))
        elif op < 0.85 and tasks:  # a run leaves: it ended, or its client stopped waiting
            key = rng.choice(sorted(tasks))
            tasks.pop(key).cancel()
            preempted_for = plugin.leave(key)
            if preempted_for is not None and rng.random() < 0.8:  # its client enters it again (readmitted)
                n += 1
                again = f"k{n}"
                asked[again] = {**asked[key], "task": f"task-{again}"}
                tasks[again] = asyncio.ensure_future(plugin.place(again, **asked[again]))
        elif op < 0.9:  # a client goes away
            client = rng.choice(["c1", "c2"])
            plugin.remove_client(scheduler, client)
            for key in [k for k in tasks if asked[k]["client"] == client]:
                tasks.pop(key).cancel()
        elif op < 0.95 and len(plugin.addresses) > 2:  # a worker dies; another joins
            gone = rng.choice([a for a in plugin.addresses if a in scheduler.workers])
            del scheduler.workers[gone]
            plugin.remove_worker(scheduler, gone)
            spare += 1
            fresh = f"tcp://spare{spare}"
            scheduler.workers[fresh] = SimpleNamespace(resources={"GPU": 2}, name=fresh)
            plugin.add_worker(scheduler, fresh)
        for _ in range(4):  # let the loop run the dispatches and answers of this step
            await asyncio.sleep(0)
        check_books(plugin)
    for key in sorted(tasks):  # everything ends
        tasks.pop(key).cancel()
        plugin.leave(key)
    for _ in range(4):
        await asyncio.sleep(0)
    plugin._expire_requeue(float("inf"))
    for key in list(plugin.keys):
        plugin.leave(key)
    check_books(plugin)
    assert policy.runs == {} and policy.alone == {} and policy.done_by == {} and policy.claims == {}
    assert all(v[0] == 0 for v in policy.pending.values()) and policy.estimates.view == {}
    check_events(policy.events)
    return policy


@pytest.mark.parametrize("seed", range(4))
def test_the_policys_books_match_the_queue_through_thousands_of_random_steps(seed):
    policy = asyncio.run(drive(seed, 1500))
    seqs = policy.events.values()
    assert sum("start" in s for s in seqs) > 300  # the walk did start runs of every kind
    assert any(s.count("start") > 1 for s in seqs)  # and preempted runs came back under their id


def test_a_fraction_that_joins_a_shared_device_is_started_and_finished_in_the_books():
    async def scenario():
        policy = SpyPolicy()
        plugin = GPUQueuePlugin(policy)
        await plugin.start(Scheduler(["tcp://w0"]))
        await asyncio.sleep(0)
        first = asyncio.ensure_future(plugin.place("f1", tenant="a", gpus=0.25, estimate=600.0))
        second = asyncio.ensure_future(plugin.place("f2", tenant="b", gpus=0.25, estimate=600.0))
        await asyncio.gather(first, second)
        opener, joiner = plugin.keys["f1"], plugin.keys["f2"]
        assert policy.events[opener] == ["submit", "start"] and policy.events[joiner] == ["submit", "start"]
        assert set(policy.runs) == {opener, joiner}
        plugin.leave("f1")  # the opener ends first: finished in the books, its device still counted busy
        assert policy.events[opener][-1] == "finish" and set(policy.runs) == {joiner}
        assert plugin.state.free == [1]
        plugin.leave("f2")
        assert policy.events[joiner][-1] == "finish" and policy.runs == {} and plugin.state.free == [2]

    asyncio.run(scenario())


def test_a_preempted_run_entered_again_keeps_its_id_and_first_submit():
    async def scenario():
        policy = SpyPolicy()
        plugin = GPUQueuePlugin(policy)
        scheduler = Scheduler(["tcp://w0"])
        await plugin.start(scheduler)
        await asyncio.sleep(0)
        borrowed = [asyncio.ensure_future(plugin.place(f"a{i}", tenant="a", gpus=1, estimate=600.0, client="ca",
                                                       preemptible=True, task=f"t{i}")) for i in range(2)]
        await asyncio.gather(*borrowed)
        ids = {plugin.keys[f"a{i}"]: f"a{i}" for i in range(2)}
        first_submit = {j: plugin.running[j][0].job.submit for j in ids}
        b = asyncio.ensure_future(plugin.place("b", tenant="b", gpus=1, estimate=60.0, client="cb"))
        await b
        (victim,) = [j for j in ids if j not in plugin.running]
        assert plugin.leave(ids[victim]) == "b"
        again = asyncio.ensure_future(plugin.place("a-again", tenant="a", gpus=1, estimate=600.0, client="ca",
                                                   preemptible=True, task="t-again"))
        await asyncio.sleep(0)
        assert plugin.keys["a-again"] == victim and plugin.waiters[victim][1].submit == first_submit[victim]
        assert policy.events[victim] == ["submit", "start", "submit"]
        plugin.leave("b")
        await again
        assert policy.events[victim] == ["submit", "start", "submit", "start"]
        for key in ("a-again", *[k for j, k in ids.items() if j != victim]):
            plugin.leave(key)
        assert policy.runs == {} and policy.alone == {} and policy.done_by == {}

    asyncio.run(scenario())


def test_under_declaring_plans_a_tenants_runs_on_its_worst_recent_overrun():
    """A tenant whose run ran 11x its estimate has its waiting and later runs planned 11x (queue order, alone time,
    backfill), so declaring short buys no place in the queue; a tenant that never overran plans on what it said.
    The overrun counts as soon as a run passes its planned end, before it ends (by doublings: 8x at 10x)."""
    from dask_gpu.policies.interface import ClusterState, Job, Running

    policy, state = FinishTimeFair(), ClusterState(free=[1, 1])
    liar = Job(1, "liar", 1, 0.0, 100.0)
    policy.submit(liar, state)
    (start,) = policy.schedule(0.0, state)
    state.running.append(Running(start.job, start.host, 0.0))
    waiting = [Job(2, "liar", 1, 1.0, 100.0), Job(3, "honest", 1, 1.0, 500.0)]
    for job in waiting:
        policy.submit(job, state)
    state.free[1] = 0  # the other GPU busy: both wait
    assert [j.id for j in policy.order(50.0, state)] == [2, 3]  # 100 s of work before 500 s
    policy.schedule(1000.0, state)  # the liar's run is 10x past its 100 s: it counts now
    assert policy.estimates.factor("liar") == pytest.approx(8.0) and policy.estimates.factor("honest") == 1.0
    assert [j.id for j in policy.order(1000.0, state)] == [3, 2]  # planned 800 s now: behind the honest 500 s
    assert policy.estimates.planned(waiting[0]).estimate == pytest.approx(800.0)
    state.release(state.running[0])
    policy.finish([liar], 1100.0)  # it ended after 1100 s: its history says 11x
    assert policy.estimates.factor("liar") == pytest.approx(11.0)
    later = Job(4, "liar", 1, 1200.0, 100.0)
    policy.submit(later, state)
    assert policy.estimates.planned(later).estimate == pytest.approx(1100.0)
    assert FinishTimeFair(correct_estimates=False).estimates.factor("liar") == 1.0


def test_the_live_queue_and_the_simulator_read_one_policy_configuration():
    """The plugin's default policy is PolicyConfig's, as read from Dask's config; a wrong key is named, with a fix."""
    import dask

    from dask_gpu.policies.config import PolicyConfig, PolicyConfigError

    live = GPUQueuePlugin().policy
    config = PolicyConfig()
    assert (live.half_life, live.sharpness, live.horizon, live.tail_quiet) == (
        config.half_life, config.sharpness, config.horizon, config.tail_quiet) == (7 * 86400.0, 4.0, 21600.0, 3600.0)
    with dask.config.set({"dask-gpu.queue-policy": {"half-life": 86400, "sharpness": 2}}):
        assert GPUQueuePlugin().policy.half_life == 86400 and GPUQueuePlugin().policy.sharpness == 2
        with dask.config.set({"dask-gpu.queue-policy.sharpnes": 3}):
            with pytest.raises(PolicyConfigError, match="sharpnes.*Fix:"):
                GPUQueuePlugin()


def test_a_worker_that_joins_for_another_tenant_is_never_added_to_a_waiting_runs_workers():
    """A waiting run may start on a worker that joins after its admission, unless that worker was started for
    another tenant (it would refuse the run): the queue reads the tenant each worker advertises."""
    tenants = {"tcp://w0": "a", "tcp://w1": "b", "tcp://w2": None}

    class Tenanted(Scheduler):
        async def broadcast(self, msg, workers, on_error="raise"):
            got = await super().broadcast(msg, workers, on_error)
            if msg["op"] == "gpu_inventory":
                for w, answer in got.items():
                    answer["inventory"]["tenant"] = tenants[w]
            return got

    async def scenario():
        plugin = GPUQueuePlugin(SpyPolicy())
        scheduler = Tenanted(["tcp://w0"])
        await plugin.start(scheduler)
        await asyncio.sleep(0)
        first = await plugin.place("r1", tenant="a", gpus=2, estimate=600.0, workers=["tcp://w0"])
        assert first is not None and first["workers"] == ["tcp://w0"]
        waiting = asyncio.ensure_future(plugin.place("r2", tenant="a", gpus=2, estimate=600.0, workers=["tcp://w0"]))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        for address in ("tcp://w1", "tcp://w2"):
            scheduler.workers[address] = SimpleNamespace(resources={"GPU": 2}, name=address)
            plugin.add_worker(scheduler, address)
            for _ in range(50):  # the queue learns the new worker's inventory
                if address in plugin.devices:
                    break
                await asyncio.sleep(0.01)
            if address == "tcp://w1":
                await asyncio.sleep(0.05)
                assert not waiting.done(), "a run of tenant a was placed on tenant b's worker"
        started = await asyncio.wait_for(waiting, 5)
        assert started["workers"] == ["tcp://w2"] and plugin.tenant_of == tenants

    asyncio.run(scenario())
