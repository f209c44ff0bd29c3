"""The pure queue policies and the simulator, on workloads small enough to reason about by hand."""

from __future__ import annotations

import math

import pytest

from dask_gpu.sim.policies import (
    ClusterState,
    EasyBackfill,
    FairShare,
    Fifo,
    Job,
    Las2D,
    MaxMinFair,
    PlainDask,
    Running,
    SjfEasy,
    max_min_shares,
    reservation,
)
from dask_gpu.sim.metrics import jain, percentile
from dask_gpu.sim.simulator import simulate


def job(i, gpus, submit=0.0, duration=10.0, tenant="a"):
    return Job(id=i, tenant=tenant, gpus=gpus, submit=submit, estimate=duration)


def run(policy, jobs, hosts=1, gpus=4):
    return simulate(jobs, {j.id: j.estimate for j in jobs}, policy, hosts, gpus)


def starts_of(policy, jobs, hosts=1, gpus=4):
    """Start time of each job id under `policy`."""
    return run(policy, jobs, hosts, gpus).started


def test_fifo_head_of_line_blocking_and_easy_backfill_around_it():
    # 3 GPUs busy for 10 s; a 4-GPU job waits; a 1-GPU 5 s job behind it fits the idle GPU and ends in time.
    jobs = [job(0, 3, duration=10), job(1, 4, submit=1), job(2, 1, submit=2, duration=5)]
    assert starts_of(Fifo(), jobs)[2] == 20.0  # behind the head, though a GPU sat idle
    easy = starts_of(EasyBackfill(), jobs)
    assert easy[2] == 2.0 and easy[1] == 10.0  # backfilled, and the head was not delayed


def test_backfill_never_delays_the_head_reservation():
    # The 1-GPU job behind the head would run 50 s, past the head's reservation at t=10: it must wait.
    jobs = [job(0, 3, duration=10), job(1, 4, submit=1), job(2, 1, submit=2, duration=50)]
    easy = starts_of(EasyBackfill(), jobs)
    assert easy[1] == 10.0 and easy[2] >= 20.0


def test_plain_dask_model_runs_each_hosts_queue_in_submit_order_and_its_head_blocks():
    jobs = [job(0, 4, duration=10), job(1, 4, submit=1), job(2, 1, submit=2)]
    s = starts_of(PlainDask(1), jobs)
    assert s[1] == 10.0 and s[2] == 20.0  # the 1-GPU job waits behind the 4-GPU head (nothing is free anyway)


def test_reservation_is_the_earliest_host_that_frees_enough():
    state = ClusterState(free=[0, 1], running=[Running(job(0, 4, duration=30), 0, 0.0), Running(job(1, 3, duration=5), 1, 0.0)])
    assert reservation(job(9, 4), 0.0, state) == (5.0, {1: 0})


def test_fair_share_serves_the_tenant_below_its_share_first():
    # Tenant a has filled the cluster's queue first; b arrives later with one job: b goes next.
    jobs = [job(i, 4, submit=0.0, tenant="a") for i in range(4)] + [job(9, 4, submit=1.0, tenant="b")]
    s = starts_of(FairShare(), jobs)
    assert s[9] == 10.0 and sorted(t for i, t in s.items() if i != 9)[1] == 20.0


def test_aging_bounds_how_long_a_big_job_waits_behind_a_stream_of_small_ones():
    small = [job(i, 1, submit=float(i), duration=4.0) for i in range(1, 400)]
    big = job(0, 4, submit=0.5, duration=4.0)
    s = starts_of(FairShare(aging=20.0), [big, *small])
    assert s[0] < 100  # without aging (and with shortest-first) it would wait for the whole stream


def test_max_min_shares_water_fill():
    assert max_min_shares(10, {"a": 2, "b": 10, "c": 10}) == {"a": 2, "b": 4, "c": 4}
    assert max_min_shares(12, {"a": 12, "b": 12}, {"a": 2, "b": 1}) == {"a": 8, "b": 4}


def test_lower_bound_and_metrics_are_consistent():
    jobs = [job(i, 2, submit=float(i), duration=10.0, tenant="ab"[i % 2]) for i in range(20)]
    durations = {j.id: j.estimate for j in jobs}
    for policy in (PlainDask(2), Fifo(), EasyBackfill(), FairShare()):
        out = simulate(jobs, durations, policy, 2, 4)
        assert out.makespan >= out.lower_bound - 1e-9 and 0 < out.utilization <= 1 and 0 < out.jain <= 1
        assert out.mean_jct >= 10.0 and out.p95_jct >= out.mean_jct - 1e-9


def test_jain_index_and_interpolated_percentile():
    assert jain([1, 1, 1]) == 1.0 and jain([1, 0]) == pytest.approx(0.5)
    assert percentile(range(1, 101), 95) == pytest.approx(95.05)  # nearest rank would say 96


def test_a_job_wider_than_the_cluster_is_reported():
    with pytest.raises(RuntimeError, match="never ran"):
        run(Fifo(), [job(0, 12)], hosts=2, gpus=4)


def test_no_policy_overcommits_a_host_on_a_random_busy_workload():
    import random

    rng = random.Random(7)
    jobs = [Job(id=i, tenant=f"t{rng.randrange(4)}", gpus=rng.choice([1, 1, 2, 4, 8]), submit=rng.uniform(0, 5000),
                estimate=rng.uniform(10, 3000)) for i in range(400)]
    for policy in (PlainDask(4), Fifo(), EasyBackfill(), FairShare(), SjfEasy(), Las2D(), MaxMinFair()):
        out = simulate(jobs, {j.id: j.estimate for j in jobs}, policy, 4, 8)  # raises on any over-commit
        assert max(sum(r.values()) for _, r, _ in out.timeline) <= 32


def test_a_tenant_running_nothing_gets_the_last_free_gpu():
    # a fills 3 of 4 GPUs and queues more; b arrives with one job: the last GPU is kept for it (headroom).
    jobs = [job(i, 1, submit=0.0, duration=100.0, tenant="a") for i in range(6)] + [job(9, 1, submit=5.0, tenant="b")]
    s = starts_of(FairShare(headroom=1), jobs)
    assert s[9] == 5.0 and sorted(s[i] for i in range(6))[3] == 100.0


def test_a_job_wider_than_its_tenants_quota_still_runs_when_the_tenant_runs_nothing():
    # 10 tenants active: quota 3.2 of 32 GPUs. b's 8-GPU 5 h job is wider than that and too long to borrow;
    # the others keep the cluster busy with short jobs. It must still start long before the stream ends.
    stream = [job(100 + i, 1, submit=float(i * 60), duration=1800.0, tenant=f"t{i % 9}") for i in range(400)]
    big = job(0, 8, submit=30.0, duration=5 * 3600.0, tenant="b")
    s = starts_of(FairShare(), [big, *stream], hosts=4, gpus=8)
    assert s[0] < 3600.0


def test_reservations_for_several_tenants_below_their_share():
    # Two tenants each wait with a 4-GPU job behind a stream of 1-GPU jobs of a third: both are reserved a host
    # and start when their hosts drain, neither waits for the stream to end.
    stream = [job(100 + i, 1, submit=float(i), duration=50.0, tenant="c") for i in range(300)]
    jobs = [*stream, job(1, 4, submit=0.5, duration=10.0, tenant="a"), job(2, 4, submit=0.5, duration=10.0, tenant="b")]
    s = starts_of(FairShare(), jobs, hosts=2, gpus=4)
    assert s[1] <= 51.0 and s[2] <= 51.0



def test_a_tenant_reclaims_its_quota_from_preemptible_borrowed_runs_only():
    # a alone fills 2 hosts x 4 GPUs with long runs (it borrows b's quota); b arrives with a 4-GPU job.
    from dataclasses import replace

    def case(preemptible: bool, resume: bool = False):
        borrowed = [replace(job(i, 1, submit=0.0, duration=1000.0, tenant="a"), preemptible=preemptible) for i in range(8)]
        b = job(99, 4, submit=10.0, duration=50.0, tenant="b")
        out = simulate([*borrowed, b], {j.id: j.estimate for j in [*borrowed, b]}, FairShare(headroom=0), 2, 4,
                       resume_preempted=resume)
        return out, starts_of(FairShare(headroom=0), [*borrowed, b], hosts=2, gpus=4)

    out, starts = case(preemptible=False)
    assert out.preempted == 0 and starts[99] == 1000.0  # nothing may be stopped: b waits for a's runs to end
    out, starts = case(preemptible=True)
    assert starts[99] == 10.0 and out.preempted == 4  # four of a's runs on one host give b its quota back
    assert out.wasted_gpu_hours == pytest.approx(4 * 10.0 / 3600)  # they had run 10 s each, restarted
    resumed, _ = case(preemptible=True, resume=True)
    assert resumed.wasted_gpu_hours == 0 and resumed.makespan < out.makespan  # a task that checkpoints loses nothing


def test_weights_give_a_tenant_its_weighted_share():
    # Two tenants each queue four long 1-GPU runs behind a 4-GPU run of c; a weighs 3, b 1: when c's run
    # ends, a gets three GPUs, b one.
    jobs = [job(99, 4, duration=10.0, tenant="c")] + [job(i, 1, submit=1.0, duration=100.0, tenant="a") for i in range(4)] + [
        job(10 + i, 1, submit=1.0, duration=100.0, tenant="b") for i in range(4)]
    starts = starts_of(FairShare(weights={"a": 3.0}, headroom=0), jobs)
    at_once = [j.tenant for j in jobs if starts[j.id] == 10.0]
    assert sorted(at_once) == ["a", "a", "a", "b"]


def test_once_submissions_stop_the_longest_waiting_job_starts_first():
    # A 4-GPU run holds the host for 4000 s; behind it 8 short runs and 1 long one, submitted just after.
    # At 4000 s nothing was submitted for an hour: the long run starts first (longest first, LPT) and
    # the queue ends at 9000 s, where shortest-first would start it last and end at 11000 s.
    blocker = job(0, 4, duration=4000.0)
    shorts = [job(i, 1, submit=1.0, duration=1000.0) for i in range(1, 9)]
    long = job(9, 1, submit=1.0, duration=5000.0)
    s = starts_of(FairShare(), [blocker, *shorts, long])
    assert s[9] == 4000.0 and max(s[i] + 1000.0 for i in range(1, 9)) <= 9000.0
    assert starts_of(FairShare(tail=0), [blocker, *shorts, long])[9] == 6000.0  # the rule off: shortest first
    urgent = [Job(id=i, tenant="a", gpus=1, submit=1.0, estimate=1000.0, priority=1) for i in range(1, 9)]
    assert starts_of(FairShare(), [blocker, *urgent, long])[9] == 6000.0  # priority still comes first


def test_ours_reclaims_a_quota_from_preemptible_borrowed_runs_only():
    """FinishTimeFair (the live queue's default) preempts as FairShare does: a tenant whose best job fits its quota
    (its part among the tenants that run or wait now) but no host gets GPUs back from preemptible borrowed runs."""
    from dataclasses import replace

    from dask_gpu.sim.policies import FinishTimeFair

    def case(preemptible: bool, resume: bool = False):
        borrowed = [replace(job(i, 1, submit=0.0, duration=1000.0, tenant="a"), preemptible=preemptible) for i in range(8)]
        b = job(99, 4, submit=10.0, duration=50.0, tenant="b")
        return simulate([*borrowed, b], {j.id: j.estimate for j in [*borrowed, b]}, FinishTimeFair(), 2, 4,
                        resume_preempted=resume)

    out = case(preemptible=False)
    assert out.preempted == 0 and out.started[99] == 1000.0  # nothing may be stopped: b waits for a's runs
    assert all(out.started[i] == 0.0 for i in range(8))  # a alone had every GPU: none held idle
    out = case(preemptible=True)
    assert out.started[99] == 10.0 and out.preempted == 4  # four of a's runs on one host give b its quota back
    assert out.wasted_gpu_hours == pytest.approx(4 * 10.0 / 3600)
    resumed = case(preemptible=True, resume=True)
    assert resumed.wasted_gpu_hours == 0 and resumed.makespan < out.makespan


def test_ours_serves_the_claimant_first_and_reclaims_nothing_beyond_the_quota():
    """The GPUs a preemption frees go to the run they were taken for, not back to the stopped runs (requeued, smaller
    work); a claim beyond the claimant's quota stops nothing."""
    from dataclasses import replace

    from dask_gpu.sim.policies import FinishTimeFair

    def case(b_gpus: int):
        borrowed = [replace(job(i, 1, submit=0.0, duration=1000.0, tenant="a"), preemptible=True) for i in range(4)]
        b = job(99, b_gpus, submit=10.0, duration=5000.0, tenant="b")  # more work than any of a's
        jobs = [*borrowed, b]
        return simulate(jobs, {j.id: j.estimate for j in jobs}, FinishTimeFair(), 1, 4)

    out = case(2)  # b's quota: 2 of 4 beside a
    assert out.started[99] == 10.0 and out.preempted == 2
    assert sorted(out.ended[i] for i in range(4)) == [1000.0, 1000.0, 2000.0, 2000.0]  # requeued behind b
    out = case(3)  # beyond b's quota: it waits for a's runs to end, nothing is stopped
    assert out.preempted == 0 and out.started[99] == 1000.0


def test_the_live_queue_holds_no_gpu_idle_and_gives_borrowed_gpus_back():
    """The queue plugin's default policy (FinishTimeFair) starts a tenant's runs on every free GPU (FairShare's
    headroom kept one idle), and preempts one of them for a tenant that arrives: leave() names that tenant."""
    import asyncio
    from types import SimpleNamespace

    import time

    from dask_gpu.scheduler.queue import REQUEUE_SECONDS, GPUQueuePlugin
    from dask_gpu.sim.policies import FinishTimeFair

    stopped: list = []

    class Scheduler:
        def __init__(self) -> None:
            self.workers = {a: SimpleNamespace(resources={"GPU": 2}, name=a) for a in ("tcp://w0", "tcp://w1")}
            self.handlers: dict = {}

        async def broadcast(self, msg, workers, on_error="raise"):
            if msg["op"] == "gpu_stop":
                stopped.append((msg, workers))
            return {}

    async def scenario():
        plugin = GPUQueuePlugin()
        assert isinstance(plugin.policy, FinishTimeFair)
        await plugin.start(Scheduler())
        borrowed = [asyncio.ensure_future(plugin.run(f"a{i}", tenant="a", gpus=1, estimate=600.0, preemptible=True,
                                                     task=f"task-a{i}")) for i in range(4)]
        where = await asyncio.gather(*borrowed)
        assert sorted(where) == ["tcp://w0", "tcp://w0", "tcp://w1", "tcp://w1"]  # all four GPUs busy at once
        assert plugin.status()["free"] == {"tcp://w0": 0, "tcp://w1": 0}
        b = await plugin.run("b", tenant="b", gpus=1, estimate=10.0)
        status = plugin.status()
        assert status["preempted"] == 1 and b in ("tcp://w0", "tcp://w1")
        await asyncio.sleep(0)
        assert len(stopped) == 1 and stopped[0][0]["op"] == "gpu_stop" and stopped[0][1] == [b]
        victim = stopped[0][0]["keys"][0].removeprefix("task-")
        assert plugin.leave(victim) == "b"  # its client learns it was preempted, and for whom
        assert [plugin.leave(f"a{i}") for i in range(4) if f"a{i}" != victim] == [None, None, None]
        plugin.leave("b")
        assert plugin.status()["free"] == {"tcp://w0": 2, "tcp://w1": 2} and plugin.status()["queued"] == 0
        # The preempted run waits to be entered again by its client (keeping its first submit); one that is not
        # within REQUEUE_SECONDS ends in the policy's books then.
        assert len(plugin.requeue) == 1 and len(plugin.policy.alone) == 1
        plugin._expire_requeue(time.time() + REQUEUE_SECONDS + 1.0)
        assert plugin.requeue == {}
        # A long-lived scheduler keeps nothing of runs that ended, preemptible ones included.
        assert plugin.policy.alone == {} and plugin.policy.done_by == {} and plugin.policy.claims == {}

    asyncio.run(scenario())


def _run_to_end(policy, state, now: float, jobs: list) -> float:
    """Submit `jobs` at `now` and run everything one after another on the state's hosts; when the last one ended."""
    from dask_gpu.sim.policies import Running

    for job in jobs:
        policy.submit(job, state)
    while policy.waiting():
        runs = []
        for s in policy.schedule(now, state):
            run = Running(s.job, s.host, now, s.gang)
            state.running.append(run)
            runs.append(run)
        now = max(r.expected_end for r in runs)
        for run in runs:
            state.release(run)
            policy.finish([run.job])
    return now


def test_fairness_memory_fades_with_its_half_life():
    """Tenant b waited its whole job out behind a's (rho 2); a hundred half-lives later one job of b that starts at
    once counts as b's whole history (rho 1). Without a half-life the old wait still weighs (rho ~2). The live
    queue fades weekly."""
    from dask_gpu.scheduler.queue import GPUQueuePlugin
    from dask_gpu.sim.policies import LIVE_HALF_LIFE, ClusterState, FinishTimeFair, Job

    rhos = {}
    for half_life in (3600.0, None):
        policy, state = FinishTimeFair(half_life=half_life), ClusterState(free=[1])
        end = _run_to_end(policy, state, 0.0, [Job(1, "a", 1, 0.0, 1000.0), Job(2, "b", 1, 0.0, 1000.0)])
        # 1000 s alone, finished at 2000 s: rho 2, or more where the start (at 1000 s) outweighs the submit (0 s)
        assert end == 2000.0 and policy.rho("b", end) == pytest.approx(2.0 * 2 ** (1000 / (half_life or math.inf)))
        later = end + 100 * 3600.0
        _run_to_end(policy, state, later, [Job(3, "b", 1, later, 10.0)])
        rhos[half_life] = policy.rho("b", later)
        assert policy.alone == {} and policy.done_by == {}
    assert rhos[3600.0] == pytest.approx(1.0, abs=1e-9)
    assert rhos[None] == pytest.approx(2010 / 1010)
    assert GPUQueuePlugin().policy.half_life == LIVE_HALF_LIFE == 7 * 24 * 3600.0
    with pytest.raises(ValueError, match="half_life must be positive"):
        FinishTimeFair(half_life=0)


def test_faded_sums_stay_right_across_a_rebase_of_their_epoch():
    """Past 512 half-lives the stored sums are rescaled to a new epoch; the sum being added to is rescaled too."""
    from dask_gpu.sim.policies import ClusterState, FinishTimeFair, Job

    policy, state = FinishTimeFair(half_life=10.0), ClusterState(free=[1])
    _run_to_end(policy, state, 0.0, [Job(1, "a", 1, 0.0, 1000.0), Job(2, "b", 1, 0.0, 1000.0)])
    later = 10_000.0  # 1,000 half-lives after the epoch: this submit moves it
    _run_to_end(policy, state, later, [Job(3, "b", 1, later, 10.0)])
    assert policy.epoch == later
    assert policy.rho("b", later) == pytest.approx(1.0, abs=1e-9)
    assert all(math.isfinite(v) and v < 1e6 for v in [*policy.done.values(), *policy.alone_sum.values()])


def test_sjf_easy_runs_the_smallest_estimated_work_first_and_backfills_around_its_head():
    # A 4-GPU blocker; then, waiting, a 100 s job, a 10 s one and a 4-GPU 5 s one: smallest work first.
    jobs = [job(0, 4, duration=50), job(1, 1, submit=1, duration=100), job(2, 1, submit=2, duration=10),
            job(3, 4, submit=3, duration=5)]
    s = starts_of(SjfEasy(), jobs)
    assert s[2] == 50.0 and s[3] == 60.0 and s[1] == 65.0  # 10 GPU-s, 20 GPU-s, then 100 GPU-s
    # EASY: the head (a 4-GPU job) reserves; a short job that ends before it backfills, a long one does not
    jobs = [job(0, 3, duration=10), job(1, 4, submit=1, duration=10), job(2, 1, submit=2, duration=5),
            job(3, 1, submit=3, duration=100)]
    s = starts_of(SjfEasy(), jobs)
    assert s[2] == 2.0 and s[1] == 10.0 and s[3] == 20.0


def test_las_serves_the_tenant_with_the_least_attained_gpu_time_first():
    # a ran 4 GPUs for 2 h (8 GPU-hours: queue 1); b has run nothing (queue 0): b's later job goes before a's.
    jobs = [job(0, 4, duration=7200.0), job(1, 4, submit=10.0, duration=60.0),
            job(2, 4, submit=20.0, duration=60.0, tenant="b")]
    s = starts_of(Las2D(), jobs)
    assert s[2] == 7200.0 and s[1] == 7260.0
    assert starts_of(Fifo(), jobs)[1] == 7200.0  # submit order would serve a first


def test_max_min_fair_share_gives_each_tenant_its_half():
    # a sends eight 1-GPU runs first, b four later, on 4 GPUs: after a's first four, the GPUs alternate so that
    # each tenant holds 2 of the 4.
    jobs = [*[job(i, 1, duration=100.0) for i in range(8)], *[job(10 + i, 1, submit=1.0, duration=100.0, tenant="b")
                                                            for i in range(4)]]
    out = run(MaxMinFair(), jobs)
    assert sorted(out.started[10 + i] for i in range(4)) == [100.0, 100.0, 200.0, 200.0]
    running_at_150 = next(r for t, r, _ in reversed(out.timeline) if t <= 150.0)
    assert running_at_150 == {"a": 2, "b": 2}


def test_ours_learns_a_runs_real_time_when_it_ends():
    # Users ask for more than they need: a run asked 1000 s, waited 50 s, ran 100 s. Its tenant's rho so far is
    # corrected from (50 + 1000) / 1000 on the estimate to (50 + 100) / 100 on what it really ran, and its private
    # pool's backlog gives back the time the run did not use.
    from dask_gpu.sim.policies import FinishTimeFair

    for learn, rho in ((True, 1.5), (False, 1.05)):
        policy = FinishTimeFair(learn=learn)
        state = ClusterState(free=[4])
        policy.submit(job(0, 1, duration=1000.0), state)
        (start,) = policy.schedule(50.0, state)
        assert policy.rho("a", 50.0) == pytest.approx(1.05)
        policy.finish([start.job], 150.0)
        assert policy.rho("a", 150.0) == pytest.approx(rho)
        assert policy.runs == {} and policy.alone == {}
    assert policy.backlog["a"] == 250.0 and FinishTimeFair().backlog == {}
    policy = FinishTimeFair()
    policy.submit(job(0, 1, duration=1000.0), state := ClusterState(free=[4]))
    (start,) = policy.schedule(0.0, state)
    policy.finish([start.job], 100.0)
    assert policy.backlog["a"] == 100.0  # 250 on the estimate; the pool was free again when the run ended


def test_ours_withdraws_a_job_that_waited_past_overdue():
    """A run whose flow went away leaves the live queue unstarted after waiting long enough to be overdue (on the
    late list): it is withdrawn like any other (it raised KeyError in the scheduler's stream handler, which closed
    the control plane's connection to the scheduler)."""
    from dask_gpu.sim.policies import FinishTimeFair

    policy = FinishTimeFair()
    state = ClusterState(free=[0], size=[1])  # the one GPU is taken: the job waits
    late, other = job(1, 1, duration=10.0), job(2, 1, duration=10.0)
    policy.submit(late, state)
    policy.submit(other, state)
    assert [j.id for j in policy.order(1000.0, state)] == [1, 2] and policy.is_late == {1, 2}
    policy.withdraw([late])
    assert policy.waiting() == 1 and [j.id for j in policy.order(1001.0, state)] == [2]
    assert policy.alone_sum["a"] == pytest.approx(policy.alone[2])  # only the job still waiting counts


def test_skipping_runs_wider_and_longer_than_one_that_found_no_place_changes_no_decision(monkeypatch):
    """`NoRoom` (a decision's shortcut with a long queue) starts exactly what looking at every run would start: on a
    random busy workload with gangs, host restrictions and estimates that miss, every start is at the same time."""
    import random

    from dask_gpu.policies.config import PolicyConfig
    from dask_gpu.policies.placement import NoRoom

    rng = random.Random(11)
    jobs = [Job(id=i, tenant=f"t{rng.randrange(5)}", gpus=rng.choice([1, 1, 2, 4, 8, 16]), submit=rng.uniform(0, 20000),
                estimate=rng.uniform(60, 4 * 3600), hosts=frozenset({0, 1}) if i % 9 == 0 else None)
            for i in range(600)]
    ran = {j.id: j.estimate * rng.uniform(0.2, 1.5) for j in jobs}
    fast = simulate(jobs, ran, PolicyConfig().build(), 4, 8, batch=True).started
    monkeypatch.setattr(NoRoom, "hopeless", lambda self, job: False)
    assert simulate(jobs, ran, PolicyConfig().build(), 4, 8, batch=True).started == fast
