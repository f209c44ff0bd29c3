"""Real Dask worker processes advertising declared GPUs; no Prefect involved."""

import time

import pytest

import dask_gpu
from dask_gpu import GPURequest, InfeasibleRequest, cluster_inventories, eligible_workers


def record_devices(hold: float):
    from distributed import get_worker

    start = time.time()
    devices = [d.index for d in dask_gpu.current_devices()]
    env = dask_gpu.gpu_env()
    time.sleep(hold)
    return {"worker": get_worker().address, "devices": devices, "start": start, "end": time.time(),
            "types": [d.gpu_type for d in dask_gpu.current_devices()], "cvd": env["CUDA_VISIBLE_DEVICES"]}


def test_workers_advertise_gpus_as_resources(dask_client):
    # Not scheduler_info(): its cached identity may be overwritten by the periodic refresh (no workers) in between.
    info = dask_client.sync(dask_client.scheduler.identity, n_workers=-1)["workers"]
    resources = sorted((w["resources"]["GPU"], w["resources"].get("GPU-H100", 0), w["resources"].get("GPU-A10", 0))
                       for w in info.values())
    assert resources == [(1.0, 0, 1.0), (2.0, 2.0, 0), (2.0, 2.0, 0)]
    invs = cluster_inventories(dask_client)
    assert sorted(inv.describe() for inv in invs.values()) == ["1 x A10 24 GB", "2 x H100 80 GB", "2 x H100 80 GB"]


def test_concurrent_tasks_never_share_a_device(dask_client):
    futures = [dask_gpu.submit(dask_client, record_devices, 0.2, request=GPURequest(gpus=1 + (i % 3 == 0), gpu_type="H100"))
               for i in range(16)]
    runs = dask_client.gather(futures)
    for r in runs:
        assert r["types"] == ["H100"] * len(r["devices"])
        assert r["cvd"] == ",".join(map(str, r["devices"]))
    spans = [(r["worker"], d, r["start"], r["end"]) for r in runs for d in r["devices"]]
    for i, (w1, d1, s1, e1) in enumerate(spans):
        for w2, d2, s2, e2 in spans[i + 1:]:
            if w1 == w2 and d1 == d2:
                assert e1 <= s2 or e2 <= s1, f"device {d1} of {w1} held by two tasks at once"


def test_gpu_type_and_count_are_honoured(dask_client):
    a10 = dask_client.gather(dask_gpu.submit(dask_client, record_devices, 0, request=GPURequest(gpus=1, gpu_type="A10")))
    assert a10["types"] == ["A10"]
    two = dask_client.gather(dask_gpu.submit(dask_client, record_devices, 0, request=GPURequest(gpus=2)))
    assert two["types"] == ["H100", "H100"] and two["devices"] == [0, 1]


def test_infeasible_request_fails_fast(dask_client):
    t0 = time.perf_counter()
    with pytest.raises(InfeasibleRequest, match="largest worker .* has 2 x H100 80 GB"):
        eligible_workers(GPURequest(gpus=6), cluster_inventories(dask_client))  # 5 GPUs in all: not even a gang
    with pytest.raises(InfeasibleRequest, match="gpu_memory_gb=100"):
        eligible_workers(GPURequest(gpus=1, gpu_memory_gb=100), cluster_inventories(dask_client))
    assert time.perf_counter() - t0 < 5


def test_devices_are_released_when_the_task_raises(dask_client):
    def boom():
        raise RuntimeError("boom")

    for _ in range(3):  # the A10 worker has one device: a leak would make the next wait and fail
        with pytest.raises(RuntimeError, match="boom"):
            dask_client.gather(dask_gpu.submit(dask_client, boom, request=GPURequest(gpus=1, gpu_type="A10")))
    ok = dask_client.gather(dask_gpu.submit(dask_client, record_devices, 0, request=GPURequest(gpus=1, gpu_type="A10")))
    assert ok["devices"] == [0]


def test_current_devices_outside_a_gpu_task_is_a_clear_error():
    with pytest.raises(dask_gpu.NotOnGPUWorker, match="outside a GPU task"):
        dask_gpu.current_devices()


def test_run_subprocess_sees_exactly_its_devices(dask_client):
    def child():
        import sys

        return dask_gpu.run_subprocess([sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"],
                                       capture_output=True, text=True, check=True).stdout.strip()

    assert dask_client.gather(dask_gpu.submit(dask_client, child, request=GPURequest(gpus=2))) == "0,1"


def test_worker_entry_points_join_an_existing_scheduler_as_separate_hosts(tmp_path):
    """`dask worker --preload dask_gpu.worker.preload` and `dask-gpu-worker --declared`, as the README tells operators."""
    import os
    import subprocess
    import sys

    from distributed import Client, LocalCluster

    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__)}  # the workers unpickle this module's functions
    common = ["--nthreads", "2", "--host", "127.0.0.1", "--no-dashboard"]
    with LocalCluster(n_workers=0, processes=True, host="127.0.0.1", dashboard_address=":0") as cluster, \
            Client(cluster, set_as_default=False) as client:
        address = cluster.scheduler_address
        workers = [
            subprocess.Popen([os.path.join(bin_dir, "dask"), "worker", address, *common, "--name", "l40s-host",
                              "--preload", "dask_gpu.worker.preload"],
                             env={**env, "DASK_GPU_DECLARED": "2 GPUs, 48 GB, L40S"},
                             stdout=subprocess.DEVNULL, stderr=open(tmp_path / "l40s-host.log", "w")),
            subprocess.Popen([os.path.join(bin_dir, "dask-gpu-worker"), address, *common, "--name", "a100-host",
                              "--declared", "4 GPUs, 40 GB, A100"],
                             env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "a100-host.log", "w")),
        ]
        try:
            # Two Python processes importing Dask and this package: seconds when quiet, past a minute at load 20 on
            # two cores. Wait on the event (both joined) with a bound that holds there; a worker that exits says why.
            deadline = time.monotonic() + 300
            while len(client.scheduler_info(n_workers=-1)["workers"]) < 2:
                for w, name in zip(workers, ("l40s-host", "a100-host")):
                    assert w.poll() is None, f"{name} exited: {(tmp_path / f'{name}.log').read_text()[-3000:]}"
                assert time.monotonic() < deadline, "no 2 workers joined within 300 s: " + "; ".join(
                    f"{n}: {(tmp_path / f'{n}.log').read_text()[-500:]}" for n in ("l40s-host", "a100-host"))
                time.sleep(0.2)
            invs = cluster_inventories(client)
            assert {name: inv.describe() for name, inv in invs.items()} == {
                "l40s-host": "2 x L40S 48 GB", "a100-host": "4 x A100 40 GB"}
            l40s = dask_gpu.submit(client, record_devices, 0, request=GPURequest(gpus=2, gpu_type="L40S")).result(timeout=60)
            a100 = dask_gpu.submit(client, record_devices, 0, request=GPURequest(gpus=3, gpu_memory_gb=40)).result(timeout=60)
            assert l40s["types"] == ["L40S"] * 2 and a100["types"] == ["A100"] * 3
            with pytest.raises(InfeasibleRequest, match="gpus=3, gpu_memory_gb=48"):
                dask_gpu.submit(client, record_devices, 0, request=GPURequest(gpus=3, gpu_memory_gb=48))
        finally:
            for w in workers:
                w.terminate()
                w.wait(timeout=30)


@pytest.mark.parametrize("memory, per_device", [(30.0, 2), (50.0, 1)])
def test_fractional_tasks_share_devices_only_while_memory_fits(dask_client, memory, per_device):
    request = GPURequest(gpus=0.5, gpu_memory_gb=memory, gpu_type="H100")
    runs = dask_client.gather([dask_gpu.submit(dask_client, record_devices, 0.3, request=request) for _ in range(8)])
    events = sorted([(r["start"], 1, r["worker"], r["devices"][0]) for r in runs]
                    + [(r["end"], -1, r["worker"], r["devices"][0]) for r in runs])
    tenants: dict[tuple[str, int], int] = {}
    for _, delta, worker, device in events:
        tenants[(worker, device)] = tenants.get((worker, device), 0) + delta
        assert tenants[(worker, device)] <= per_device, f"{worker} device {device} over-committed"
    assert all(len(r["devices"]) == 1 and r["types"] == ["H100"] for r in runs)


def test_any_of_several_types(dask_client):
    request = GPURequest(gpus=1, gpu_type=("A10", "L4"))
    run = dask_gpu.submit(dask_client, record_devices, 0, request=request).result(timeout=60)
    assert run["types"] == ["A10"]
    with pytest.raises(InfeasibleRequest, match=r"gpu_type=\('L4', 'T4'\)"):
        eligible_workers(GPURequest(gpus=1, gpu_type=("L4", "T4")), cluster_inventories(dask_client))


def test_live_state_is_readable_from_the_scheduler_side(dask_client):
    states = dask_gpu.cluster_states(dask_client)
    assert sorted(states) == ["gpu-worker-0", "gpu-worker-1", "gpu-worker-2"]
    assert all(s is None for s in states.values())  # declared devices: no NVML to sample


def test_gpu_workers_run_no_frame_sampler(dask_client):
    """A GPU worker ends a thread per body (each secedes); with the worker's statistical profiler calling
    sys._current_frames() every 10 ms, CPython 3.11 deadlocks (gh-106883): every thread of the worker on one futex,
    as bench/overhead.py's 1,000-task row hung. The plugin stops that profiler on every GPU worker."""
    def sampler(dask_worker) -> list[str]:
        return sorted(n for n in dask_worker.periodic_callbacks if n.startswith("profile"))

    answers = dask_client.run(sampler)
    assert answers and all(v == [] for v in answers.values()), answers


def test_a_worker_that_stopped_answering_is_left_out_of_a_broadcast_not_waited_for():
    """The scheduler's broadcast waits for every worker: one hung worker (here SIGSTOPped) held the control plane's
    inventory read, and every admission behind it. Past dask-gpu.broadcast-seconds the others' answers come back."""
    import os
    import signal

    import dask
    from distributed import Client

    from dask_gpu import LocalGPUCluster
    from dask_gpu.client.cluster import BROADCAST_SECONDS_KEY, cluster_inventories

    with LocalGPUCluster(declared="2 workers x 1 GPUs, 80 GB, H100") as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout=120)
        assert len(cluster_inventories(client)) == 2
        pids = client.run(os.getpid)
        hung, pid = sorted(pids.items())[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            with dask.config.set({BROADCAST_SECONDS_KEY: 2}):
                answered = cluster_inventories(client)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert len(answered) == 1, answered  # the worker still answering, without the hung one


def test_the_suites_workers_keep_their_scratch_files_in_a_folder_of_the_suites_own(dask_client):
    """Never the host-wide `dask-scratch-space` of the system's temporary directory: leftovers there (another
    user's, or a 3,000-deep tree Dask cannot purge) must not fail the suite (tests/conftest.py sets the folder)."""
    import os
    import tempfile

    ours = os.path.realpath(os.environ["DASK_TEMPORARY_DIRECTORY"])
    assert ours != os.path.realpath(tempfile.gettempdir())
    where = dask_client.run(lambda dask_worker: os.path.realpath(dask_worker.local_directory))
    assert where and all(d.startswith(ours + os.sep) for d in where.values()), (ours, where)


@pytest.mark.parametrize("scheduler_process", [False, True])
def test_a_local_cluster_keeps_its_scratch_files_in_a_folder_of_its_own_and_removes_it(tmp_path, monkeypatch,
                                                                                      scheduler_process):
    """With no Dask `temporary-directory` set, Dask puts every server's scratch files in the host-wide
    `dask-scratch-space` of the system's temporary directory, shared by every cluster and user there. A
    LocalGPUCluster gives its workers and scheduler (in this process or its own) a folder of its own, and removes it
    with everything in it when it closes."""
    import os
    import tempfile

    import dask
    from distributed import Client

    from dask_gpu import LocalGPUCluster

    monkeypatch.delenv("DASK_TEMPORARY_DIRECTORY", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where this process's folders are made: here
    with dask.config.set({"temporary-directory": None}):
        with LocalGPUCluster(declared="1 workers x 1 GPUs, 80 GB, H100", scheduler_process=scheduler_process) \
                as cluster, Client(cluster) as client:
            client.wait_for_workers(1, timeout=120)
            workers = client.run(lambda dask_worker: os.path.realpath(dask_worker.local_directory))
            scheduler = client.run_on_scheduler(lambda dask_scheduler: os.path.realpath(dask_scheduler.local_directory))
            ours = os.path.realpath(tmp_path)
            assert workers and all(d.startswith(ours + os.sep) for d in [*workers.values(), scheduler]), \
                (ours, workers, scheduler)
    assert os.listdir(tmp_path) == []  # nothing left behind: not the scratch folders, not the scheduler's file
