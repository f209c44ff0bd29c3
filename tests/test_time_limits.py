"""A declared time is a limit (issue 42): the rule, the simulator playing it, the queue planning on it, and the
control plane's watch stopping the same run at the same time as the simulator."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from dask_gpu.policies.config import PolicyConfig
from dask_gpu.policies.interface import ClusterState, Job
from dask_gpu.policies.time_limits import TimeLimitError, TimeLimits
from dask_gpu.sim.policies import EasyBackfill
from dask_gpu.sim.simulator import simulate

RULE = TimeLimits(over_time=60.0, kill_wait=30.0)


def test_the_rule_asks_at_the_limit_plus_grace_and_ends_after_the_kill_wait():
    assert RULE.stop_at(100.0, 600.0) == 760.0 and RULE.kill_at(100.0, 600.0) == 790.0
    assert RULE.stop_at(100.0, None) == math.inf  # no limit: never
    assert RULE.ends(0.0, 600.0, 5000.0, requeue=False) == 690.0  # ended at the kill
    assert RULE.ends(0.0, 600.0, 5000.0, requeue=True) == 660.0  # it stops at its checkpoint when asked
    assert RULE.ends(0.0, 600.0, 650.0, requeue=False) == 650.0  # within the grace: it finishes
    with pytest.raises(TimeLimitError, match="Fix:"):
        TimeLimits(over_time=-1.0)


def test_the_simulator_ends_a_run_past_its_limit_and_requeues_one_that_checkpoints():
    jobs = [Job(0, "a", 1, 0.0, 600.0), Job(1, "b", 1, 0.0, 600.0, requeue=True), Job(2, "c", 1, 0.0, 600.0),
            Job(3, "d", 1, 0.0, 600.0, no_limit=True)]
    durations = {0: 5000.0, 1: 1500.0, 2: 100.0, 3: 5000.0}
    out = simulate(jobs, durations, EasyBackfill(), 1, 4, limits=RULE)
    assert out.ended[0] == 690.0 and out.time_limited == 1  # asked at 660, ended at 690: its work is not done
    assert out.ended[2] == 100.0  # within its limit: as it ran
    assert out.ended[3] == 5000.0  # no limit: never stopped
    # 1 stops at 660 (its checkpoint), queued again with 840 s left and the same limit: 660 + 660 (stopped again)
    # + 180 = 1500 s of work, done at 1500
    assert out.requeued == 2 and out.ended[1] == pytest.approx(1500.0)
    assert sorted((j, s, e) for j, s, e in out.stops) == [(0, 0.0, 690.0), (1, 0.0, 660.0), (1, 660.0, 1320.0)]
    before = simulate(jobs, durations, EasyBackfill(), 1, 4, limits=None)  # no limits: as before issue 42
    assert before.ended[0] == 5000.0 and before.time_limited == 0


def test_baselines_and_ours_get_the_same_limits():
    jobs = [Job(i, "ab"[i % 2], 1, 0.0, 100.0) for i in range(6)]
    durations = {i: 1000.0 for i in range(6)}
    for policy in (EasyBackfill(), PolicyConfig(over_time=10.0, kill_wait=5.0).build()):
        out = simulate(jobs, durations, policy, 1, 2, limits=TimeLimits(10.0, 5.0))
        assert out.time_limited == 6 and max(out.ended.values()) == pytest.approx(3 * 115.0)


def test_a_run_with_a_limit_is_planned_no_longer_than_it_may_hold_its_gpus():
    policy = PolicyConfig(over_time=60.0, kill_wait=30.0, no_limit_plan=3600.0).build()
    state = ClusterState(free=[8])
    policy.estimates.learn("a", 100.0, 1000.0)  # tenant a once ran 10x what it declared
    policy.submit(Job(1, "a", 1, 0.0, 600.0), state)
    policy.submit(Job(2, "a", 1, 0.0, 600.0, no_limit=True), state)
    policy.submit(Job(3, "b", 1, 0.0, 600.0, no_limit=True), state)  # b has no history
    policy.submit(Job(4, "b", 1, 0.0, 7200.0, no_limit=True), state)
    assert policy.estimates.plan_of(1)["planned"] == 690.0  # its limit + grace + kill wait, not 6000
    assert policy.estimates.plan_of(2)["planned"] == 6000.0  # no limit: the tenant's worst observed factor
    # no limit and no history: planned on the cluster's default run time, as Slurm plans a job without --time
    assert policy.estimates.plan_of(3)["planned"] == 3600.0
    assert policy.estimates.plan_of(4)["planned"] == 7200.0  # never below what it declared


def test_declaring_no_limit_never_goes_ahead_of_the_same_run_declared_honestly():
    """A new tenant declaring a quarter with no limit waits behind one declaring its true time with a limit."""
    policy = PolicyConfig().build()
    busy = ClusterState(free=[0])
    policy.submit(Job(1, "liar", 1, 0.0, 900.0, no_limit=True), busy)  # runs 3600 s, says 900 and no limit
    policy.submit(Job(2, "honest", 1, 0.0, 3600.0), busy)
    (start, *_) = policy.schedule(10.0, ClusterState(free=[1]))
    assert start.job.id == 2


def test_a_run_with_no_limit_is_charged_its_overrun_at_the_premium():
    def rho_after(no_limit: bool) -> float:
        policy = PolicyConfig(half_life=None, no_limit_premium=2.0).build()
        state = ClusterState(free=[8])
        policy.submit(Job(1, "a", 1, 0.0, 100.0, no_limit=no_limit), state)
        policy.submit(Job(2, "a", 1, 0.0, 100.0), state)
        (start, *_) = policy.schedule(0.0, ClusterState(free=[1]))
        policy.finish([start.job], 500.0)  # ran 400 s past its estimate
        return policy.rho("a", 500.0)

    honest_books, no_limit_books = rho_after(False), rho_after(True)
    # the overrun adds to both sums; a no-limit run's adds twice to what it would have taken alone: it counts as
    # served better, so its tenant's later runs are not pushed ahead by its own overrun
    assert no_limit_books < honest_books


def test_the_simulator_and_the_control_planes_watch_stop_the_same_run_at_the_same_time():
    from aisched_prefect.control.dispatch.time_limit import TimeLimitWatch
    from aisched_prefect.settings import Settings

    jobs = [Job(i, "ab"[i % 2], 1, 10.0 * i, 60.0, requeue=i % 3 == 0) for i in range(9)]
    durations = {i: [30.0, 200.0, 75.0][i % 3] for i in range(9)}
    config = PolicyConfig(over_time=20.0, kill_wait=7.0)
    out = simulate(jobs, durations, config.build(), 1, 4, batch=True, limits=config.limits())
    assert out.stops, "the trace has runs past their limits"

    settings = Settings(time_limit_grace_seconds=20.0, time_limit_kill_wait_seconds=7.0)
    stopped: list[tuple[str, bool]] = []
    dispatcher = SimpleNamespace(lock=__import__("threading").Lock(), client=None)
    watch = TimeLimitWatch(dispatcher, settings)
    import aisched_prefect.control.dispatch.time_limit as module

    module_stop = module.request_stop
    module.request_stop = lambda client, keys, soft=False: stopped.extend((k, soft) for k in keys)
    try:
        live: dict[tuple[int, float], float] = {}
        for job_id, start, _ in out.stops:  # each piece as the control plane sees it: started then, est 60 s
            req = SimpleNamespace(limit_seconds=60.0, requeue_on_time_limit=jobs[job_id].requeue)
            run = SimpleNamespace(admission=SimpleNamespace(request=req, task_name=f"job-{job_id}"), started_at=start,
                                  settled=False, stop_reason=None, dask_keys=[f"k{job_id}@{start}"])
            key = f"k{job_id}@{start}"
            running = {key: run}
            t = start
            while (job_id, start) not in live and t < start + 1000:  # the watcher's polls, every 0.5 s
                t += 0.5
                stopped.clear()
                watch.check(running, now=t)
                for _, soft in stopped:  # a run that checkpoints stops when asked; one that does not is ended
                    if soft == jobs[job_id].requeue:
                        live[(job_id, start)] = t
    finally:
        module.request_stop = module_stop
    assert {(j, s): e for j, s, e in out.stops} == live


def test_learn_down_plans_a_tenant_that_over_declares_on_what_its_runs_take_only_when_asked():
    for down, planned in ((False, 600.0), (True, 150.0), ("off", 600.0), ("tenant", 150.0), ("size", 150.0)):
        policy = PolicyConfig(learn_down=down).build()
        for i in range(5):
            policy.estimates.learn("a", 600.0, 150.0)  # its runs take a quarter of what it declares
        policy.submit(Job(1, "a", 1, 0.0, 600.0), ClusterState(free=[8]))
        policy.submit(Job(2, "a", 1, 0.0, 600.0, no_limit=True), ClusterState(free=[8]))
        assert policy.estimates.plan_of(1)["planned"] == planned
        # no limit: never planned below what it declared, nor below the default run time (6 h)
        assert policy.estimates.plan_of(2)["planned"] == 21600.0


def test_learn_down_learns_each_size_of_run_apart():
    """Users round up to a few limits: a tenant whose one-hour runs take a quarter of it and whose four-hour runs take
    all of it has its one-hour runs planned on 15 minutes and its four-hour runs on four hours."""
    policy = PolicyConfig(learn_down="size").build()
    for _ in range(5):
        policy.estimates.learn("a", 3600.0, 900.0)
        policy.estimates.learn("a", 14400.0, 14400.0)
    state = ClusterState(free=[8])
    policy.submit(Job(1, "a", 1, 0.0, 3600.0), state)
    policy.submit(Job(2, "a", 1, 0.0, 14400.0), state)
    policy.submit(Job(3, "a", 1, 0.0, 120.0), state)  # a size it has no history of: as declared
    assert policy.estimates.plan_of(1)["planned"] == 900.0
    assert policy.estimates.plan_of(2)["planned"] == 14400.0
    assert policy.estimates.plan_of(3)["planned"] == 120.0

