"""The simulator and its inputs: no hidden order, gangs kept, fairness measured as Themis does."""

from __future__ import annotations

import pytest

from bench.trace import BadTime, epoch, load, offered_load
from dask_gpu.sim.policies import EasyBackfill, FinishTimeFair, Fifo, Job, PlainDask
from dask_gpu.sim.metrics import finish_time_fairness, percentile, private_pool
from dask_gpu.sim.simulator import FAR_FRACTION, MODES, alone, simulate, user_estimate, with_estimates


def job(i, gpus, submit=0.0, duration=10.0, tenant="a"):
    return Job(id=i, tenant=tenant, gpus=gpus, submit=submit, estimate=duration)


def run(policy, jobs, hosts=1, gpus=4):
    return simulate(jobs, {j.id: j.estimate for j in jobs}, policy, hosts, gpus)


def test_the_trace_keeps_file_order_for_ties_and_keeps_gangs(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("timestamp,duration,num_gpus,gpu_time,cluster\n"
                     "2017-10-02 06:00:05,30.0,4,120.0,zz\n"
                     "2017-10-02 06:00:00,90.0,2,180.0,yy\n"
                     "2017-10-02 06:00:05,10.0,1,10.0,aa\n"   # same second as the first row: stays after it
                     "2017-10-02 06:00:07,50.0,16,800.0,aa\n"  # wider than a host: a gang, kept
                     "2017-10-02 06:00:08,50.0,128,6400.0,aa\n"  # wider than the cluster: left out
                     "2017-10-02 07:00:00,50.0,1,50.0,aa\n")   # after --end
    jobs, durations, dropped = load(trace, "2017-10-02 06:00", "2017-10-02 06:30", 8, 8, None, "clip", None)
    assert [(j.tenant, j.gpus) for j in jobs] == [("yy", 2), ("zz", 4), ("aa", 1), ("aa", 16)]
    assert dropped == {"wider than the cluster": 1}
    # offered load: GPU-seconds over 64 GPUs x (end - first submit), not the whole window
    assert offered_load(jobs, durations, 64, "2017-10-02 06:30") == pytest.approx((180 + 120 + 10 + 800) / (64 * 1800))


def test_start_and_end_take_dates_and_date_times():
    assert epoch("2017-10-02 06:00") - epoch("2017-10-02") == 6 * 3600
    with pytest.raises(BadTime, match="YYYY-MM-DD"):
        epoch("yesterday")


def test_simulate_py_accepts_a_date_time_window(capsys):
    from bench.simulate import main

    main(["--start", "2017-10-03 06:00", "--end", "2017-10-03 08:00", "--tenants", "3"])
    out = capsys.readouterr().out
    assert "max rho" in out and "ours" in out and "plain-dask" in out


def test_events_are_handled_one_at_a_time():
    # Two runs arrive in the same second on a 1-GPU host: the first in file order starts, whatever its length.
    jobs = [job(0, 1, duration=100.0), job(1, 1, duration=1.0)]
    assert run(EasyBackfill(), jobs, gpus=1).started == {0: 0.0, 1: 100.0}


def test_plain_dask_picks_the_host_with_least_occupancy_including_running_work():
    # Host 0 runs a long job (1000 s on 4 GPUs), host 1 a short one (10 s on 4 GPUs): a new 1-GPU job goes
    # to host 1 (less GPU-seconds left per GPU), though both have no free GPU now.
    jobs = [job(0, 4, duration=1000.0), job(1, 4, duration=10.0), job(2, 1, submit=1.0, duration=5.0)]
    assert run(PlainDask(2), jobs, hosts=2).started[2] == 10.0


def test_percentile_is_interpolated():
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)


def test_rho_compares_with_easy_alone_on_a_private_pool():
    # Two tenants, 1 host x 4 GPUs: pools are max(4 // 2, widest) = 2 GPUs for a, 4 for b.
    assert private_pool(1, 4, 2, 2) == [2] and private_pool(1, 4, 2, 4) == [4]
    jobs = [job(0, 2, duration=10.0, tenant="a"), job(1, 2, duration=10.0, tenant="a"), job(2, 4, submit=1.0, tenant="b")]
    durations = {j.id: j.estimate for j in jobs}
    pools = alone(jobs, durations, 1, 4)
    assert pools == {"a": 10.0 + 20.0, "b": 10.0}  # a's second job waits for its first on 2 GPUs
    out = simulate(jobs, durations, Fifo(), 1, 4).with_alone(pools)
    assert out.rho == finish_time_fairness(out.jct_by_tenant, pools)
    assert out.rho["a"] == pytest.approx((10 + 10) / 30) and out.rho["b"] == pytest.approx((10 + 9) / 10)
    assert out.max_rho == out.rho["b"] and 0 < out.min_s_active <= 1


def test_user_estimates_are_modal_never_short_and_the_same_on_every_run():
    durations = {i: 30.0 + 19.7 * i for i in range(2000)}  # 30 s to 11 h: two limits higher is always higher
    jobs = [job(i, 1, duration=1.0) for i in durations]  # what the trace said is replaced
    est = {j.id: j.estimate for j in with_estimates(jobs, durations, "user")}
    assert est == {j.id: j.estimate for j in with_estimates(jobs, durations, "user")}  # deterministic
    assert est != {j.id: j.estimate for j in with_estimates(jobs, durations, "user", seed=1)}  # seeded
    assert set(est.values()) <= set(MODES) and all(est[i] >= d for i, d in durations.items())
    # most jobs ask for the smallest limit that holds them; a seeded fraction asks two limits higher (capped)
    smallest = {i: next(m for m in MODES if m >= d) for i, d in durations.items()}
    far = {i for i in durations if est[i] != smallest[i]}
    assert abs(len(far) / len(durations) - FAR_FRACTION) < 0.03
    assert all(est[i] == MODES[min(MODES.index(smallest[i]) + 2, len(MODES) - 1)] for i in far)
    assert user_estimate(60.0, 1) == 900.0 and user_estimate(60.0, 3) == 4 * 3600.0  # key 3 is one of the far ones
    assert user_estimate(5 * 86400 + 1, 1) == 6 * 86400  # beyond the largest mode: whole days, still not short


def test_oracle_and_no_estimates_and_a_bad_model():
    durations = {0: 50.0, 1: 7000.0}
    jobs = [job(i, 1, duration=1.0) for i in durations]
    assert [j.estimate for j in with_estimates(jobs, durations, "oracle")] == [50.0, 7000.0]
    assert [j.estimate for j in with_estimates(jobs, durations, "none", limit=21600)] == [21600, 21600]
    with pytest.raises(ValueError, match="user, oracle, none"):
        with_estimates(jobs, durations, "exact")


def test_a_job_runs_its_real_time_whatever_it_asked():
    jobs = with_estimates([job(0, 1), job(1, 1, submit=1.0)], {0: 60.0, 1: 30.0}, "user")
    assert jobs[0].estimate == 900.0
    out = simulate(jobs, {0: 60.0, 1: 30.0}, Fifo(), 1, 1)
    assert out.ended == {0: 60.0, 1: 90.0}


def test_rho_as_themis_sizes_the_pool_by_the_contention_each_tenant_met():
    # 2 hosts x 4 GPUs. b's 4-GPU 10 s job and a's four 2-GPU 100 s jobs arrive at 0 (b first, FIFO): b and two of
    # a's run at once, a's other two start at 10 when b ends. a had work over [0, 110) and b with it over [0, 10):
    # contention a = (2 x 10 + 1 x 100) / 110, b = 2.
    jobs = [job(0, 4, tenant="b"), *[job(1 + i, 2, duration=100.0) for i in range(4)]]
    durations = {j.id: j.estimate for j in jobs}
    out = simulate(jobs, durations, Fifo(), 2, 4).with_fairness(jobs, durations, 2, 4)
    assert out.contention == pytest.approx({"a": 120 / 110, "b": 2.0})
    assert out.jct_by_tenant == {"a": 100 + 100 + 110 + 110, "b": 10.0}
    # Themis: a's pool is floor(8 / 1.09) = 7 GPUs (hosts of 4 and 3): three of its jobs at once, alone 500 s;
    # with N = every tenant (2) its pool is 4 GPUs: two at once, alone 600 s. b: 4 GPUs either way.
    assert out.rho == pytest.approx({"a": 420 / 500, "b": 1.0})
    assert out.rho_slice == pytest.approx({"a": 420 / 600, "b": 1.0})
    assert out.max_rho == 1.0 and out.max_rho_slice == 1.0


def test_ours_serves_a_light_tenants_job_before_a_heavy_tenants_backlog():
    # a floods 1 host x 4 GPUs with 1-GPU 100 s runs; b sends one 1-GPU run later. Shortest first alone would
    # put b behind a's equally short runs; b's private pool is idle, so b's run is owed and starts first.
    heavy = [job(i, 1, duration=100.0, tenant="a") for i in range(12)]
    light = job(99, 1, submit=5.0, duration=100.0, tenant="b")
    s = run(FinishTimeFair(), [*heavy, light]).started
    assert s[99] == 100.0 and sorted(s[i] for i in range(12))[4] == 100.0
    assert run(Fifo(), [*heavy, light]).started[99] == 300.0


def test_ours_runs_the_smallest_work_first_among_a_heavy_tenants_jobs():
    blocker = job(0, 4, duration=10.0, tenant="c")
    big = job(1, 4, submit=1.0, duration=100.0)
    small = [job(2 + i, 1, submit=2.0, duration=10.0) for i in range(8)]
    s = run(FinishTimeFair(tail=0), [blocker, big, *small, *[job(20 + i, 1, submit=1.0, duration=10.0, tenant="d")
                                                             for i in range(8)]]).started
    assert s[1] > max(s[2 + i] for i in range(8))  # the 400 GPU-s job after the 10 GPU-s ones


def test_the_examples_in_the_docstrings_hold():
    import doctest

    import bench.trace
    import dask_gpu.policies.estimates
    import dask_gpu.policies.fairness_books
    import dask_gpu.policies.placement
    import dask_gpu.sim.policies
    import dask_gpu.sim.metrics
    import dask_gpu.sim.simulator

    for module in (bench.trace, dask_gpu.policies.estimates, dask_gpu.policies.fairness_books,
                   dask_gpu.policies.placement, dask_gpu.sim.policies, dask_gpu.sim.metrics, dask_gpu.sim.simulator):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_a_light_tenants_big_job_does_not_pass_everyones_small_ones():
    # As above, and b also sends a 4-GPU 1000 s run. b is behind: its small run still goes first, but its big
    # one waits for a's 100 s runs (fairness over work): a's last runs start at 300 s, not after b's 1000 s.
    heavy = [job(i, 1, duration=100.0, tenant="a") for i in range(12)]
    light = [job(99, 1, submit=5.0, duration=100.0, tenant="b"), job(98, 4, submit=5.0, duration=1000.0, tenant="b")]
    s = run(FinishTimeFair(tail=0), [*heavy, *light]).started
    assert s[99] == 100.0 and s[98] == 400.0 and max(s[i] for i in range(12)) == 300.0
    s = run(FinishTimeFair(tail=0, sharpness=0), [*heavy, *light]).started  # the tiers: all of b's jobs first
    assert s[98] == 200.0 and max(s[i] for i in range(12)) == 1300.0
