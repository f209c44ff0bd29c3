"""The starvation bound (`PolicyConfig.starve_after`): a light tenant's run does not wait behind a heavy backlog."""

from __future__ import annotations

import dask

from dask_gpu.policies.config import PolicyConfig
from dask_gpu.policies.interface import ClusterState, Job, Running
from dask_gpu.scheduler.queue import GPUQueuePlugin
from dask_gpu.sim.simulator import simulate

HOUR = 3600.0
BOUND = 2 * HOUR


def busy_cluster() -> list[Job]:
    """Two hosts of 8 GPUs, every GPU running a heavy tenant's multi-hour run (3-5.5 h), 300 more one-hour runs of
    it queued, and a light tenant's one-host run (8 GPUs, 1 h) arriving 10 minutes in."""
    running = [Job(i, "heavy", 1, 0.0, 3 * HOUR + i * 600.0) for i in range(16)]
    backlog = [Job(100 + i, "heavy", 1, 1.0 + i, HOUR) for i in range(300)]
    return [*running, *backlog, Job(999, "light", 8, 600.0, HOUR)]


def light_start(**settings: float) -> tuple[float, float]:
    """When the light run starts, and when the heavy backlog's last run starts. Ordering rules that would serve a
    behind tenant early are off (`behind`, `overdue`): what is left is smallest work first, which alone would keep
    filling each freed GPU with a one-GPU run of the heavy tenant."""
    jobs = busy_cluster()
    policy = PolicyConfig(behind=1e9, overdue=0, **settings).build()
    out = simulate(jobs, {j.id: j.estimate for j in jobs}, policy, 2, 8, batch=True)
    return out.started[999], max(out.started[j.id] for j in jobs if j.id >= 100 and j.id != 999)


def test_without_the_bound_the_light_run_waits_for_the_whole_heavy_backlog():
    light, backlog = light_start()
    assert light >= backlog  # the case the bound is for (smallest work first starves the wide run)


def test_with_the_bound_the_light_run_starts_at_its_reservation_not_after_the_backlog():
    """Once the light run waited `starve_after`, it holds the host that drains first: it starts when that host's
    runs end (here every heavy run has a known end), within the bound + the longest run there."""
    light, backlog = light_start(starve_after=BOUND)
    submit, longest = 600.0, 3 * HOUR + 15 * 600.0
    assert submit + BOUND <= light <= submit + BOUND + longest
    assert light < backlog - 5 * HOUR  # long before the heavy backlog is served
    off, _ = light_start()
    assert light < off


def test_a_heavy_tenants_old_backlog_is_not_starved():
    """A tenant above its quota, or whose part of the waiting work is larger than its quota's part, is not light:
    its old runs keep the smallest-first order."""
    policy = PolicyConfig(starve_after=BOUND).build()
    state = ClusterState(free=[0, 0], running=[Running(Job(i, "heavy", 2, 0.0, 4 * HOUR), i % 2, 0.0)
                                               for i in range(8)])
    for i in range(50):
        policy.submit(Job(100 + i, "heavy", 1, 0.0, HOUR), state)
    policy.submit(Job(999, "light", 4, 0.0, HOUR), state)
    policy.submit(Job(998, "medium", 1, 0.0, HOUR), state)
    for i in range(40):
        policy.submit(Job(200 + i, "medium", 1, 1.0, HOUR), state)
    starved = policy.starved(BOUND + 1.0, state)
    assert [j.id for j in starved] == [999]  # heavy: above quota; medium: most of the waiting work
    assert policy.starved(BOUND - 1.0, state) == []
    assert next(iter(policy.order(BOUND + 1.0, state))).id == 999  # served first


def test_the_live_queue_reads_the_bound_from_the_one_configuration():
    assert GPUQueuePlugin().policy.starve_after == PolicyConfig().starve_after
    with dask.config.set({"dask-gpu.queue-policy": {"starve-after": 7200}}):
        assert GPUQueuePlugin().policy.starve_after == 7200.0
