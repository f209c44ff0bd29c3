"""Property tests: random mixes of whole, multi-GPU and fractional requests on random inventories."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dask_gpu import DeviceUnavailable, GPURequest, WorkerInventory
from dask_gpu.worker.allocator import DeviceAllocator
from dask_gpu.inventory import GPUDevice

TYPES = ["H100", "A100", "A10"]

devices_st = st.lists(
    st.tuples(st.sampled_from(TYPES), st.sampled_from([24.0, 40.0, 80.0])), min_size=1, max_size=6
).map(lambda specs: tuple(
    GPUDevice(index=i, uuid=f"GPU-{i}", name=t, gpu_type=t, memory_gb=m) for i, (t, m) in enumerate(specs)
))

request_st = st.one_of(
    st.builds(GPURequest, gpus=st.integers(1, 4), gpu_type=st.none() | st.sampled_from(TYPES),
              gpu_memory_gb=st.none() | st.sampled_from([20.0, 40.0, 80.0])),
    st.builds(GPURequest, gpus=st.sampled_from([0.25, 0.5, 0.75]),
              gpu_type=st.none() | st.sampled_from(TYPES) | st.just(("H100", "A100")),
              gpu_memory_gb=st.none() | st.sampled_from([8.0, 20.0, 40.0, 60.0])),
)

ops_st = st.lists(st.tuples(st.booleans(), request_st, st.integers(0, 10**6)), min_size=1, max_size=40)


def check_invariants(alloc: DeviceAllocator, devices: tuple[GPUDevice, ...], held: dict[str, GPURequest]) -> None:
    by_key = {d.key: d for d in devices}
    for key, (fraction, memory) in alloc.usage().items():
        assert fraction <= 1.0 + 1e-9, f"device {key} over-committed in compute: {fraction}"
        assert memory <= by_key[key].memory_gb + 1e-6, f"device {key} over-committed in memory: {memory}"
    holders = alloc.holders()
    assert set(holders) == set(held)
    for task, keys in holders.items():
        request = held[task]
        assert len(keys) == request.devices_needed  # all or nothing, never partial
        for k in keys:
            assert request.type_fits(by_key[k])
            if not request.fractional:  # a whole-GPU task never shares
                assert all(k not in other for t, other in holders.items() if t != task)
                assert request.gpu_memory_gb is None or by_key[k].memory_gb >= request.gpu_memory_gb


@settings(max_examples=300, deadline=None)
@given(devices=devices_st, ops=ops_st)
def test_no_device_is_ever_over_committed(devices, ops):
    alloc = DeviceAllocator(devices)
    held: dict[str, GPURequest] = {}
    for n, (release, request, pick) in enumerate(ops):
        if release and held:
            victim = sorted(held)[pick % len(held)]
            alloc.release(victim)
            del held[victim]
        else:
            key = f"task-{n}"
            try:
                alloc.acquire(key, request, timeout=0)
                held[key] = request
            except DeviceUnavailable:
                pass
        check_invariants(alloc, devices, held)


@settings(max_examples=200, deadline=None)
@given(devices=devices_st, requests=st.lists(request_st, min_size=1, max_size=20))
def test_every_request_that_fits_the_worker_eventually_runs(devices, requests):
    """Run requests one wave at a time, releasing each wave: anything that fits an idle worker gets its turn."""
    alloc = DeviceAllocator(devices)
    inventory = WorkerInventory(devices=devices)
    waiting = [(f"t{i}", r) for i, r in enumerate(requests) if r.fits(inventory)]
    for _ in range(len(waiting) + 1):
        if not waiting:
            break
        started = []
        for key, request in list(waiting):
            try:
                alloc.acquire(key, request, timeout=0)
                started.append(key)
            except DeviceUnavailable:
                continue
        assert started, "an idle worker refused every request that fits it"
        for key in started:
            alloc.release(key)
        waiting = [(k, r) for k, r in waiting if k not in started]
    assert not waiting
    assert all(f == 0 and m == 0 for f, m in alloc.usage().values())  # released means released


def test_fractions_share_a_device_only_while_memory_fits():
    h100 = tuple(GPUDevice(index=i, uuid=f"GPU-{i}", name="H100", gpu_type="H100", memory_gb=80.0) for i in range(2))
    alloc = DeviceAllocator(h100)
    quarter = GPURequest(gpus=0.25, gpu_memory_gb=20)
    placed = [alloc.acquire(f"q{i}", quarter, timeout=0)[0].key for i in range(8)]
    assert sorted(placed) == ["0"] * 4 + ["1"] * 4  # packed: four quarters per device
    try:
        alloc.acquire("more", quarter, timeout=0)
        raise AssertionError("a ninth quarter fit on two devices")
    except DeviceUnavailable:
        pass
    for i in range(4):
        alloc.release(f"q{i}")
    big = GPURequest(gpus=0.5, gpu_memory_gb=70)
    assert alloc.acquire("big", big, timeout=0)[0].key == "0"
    try:
        alloc.acquire("whole", GPURequest(gpus=1), timeout=0)  # both devices have tenants
        raise AssertionError("a whole-GPU task shared a device")
    except DeviceUnavailable:
        pass


def test_live_state_keeps_a_device_filled_by_another_process_out():
    """Where NVML reports memory in use by someone else, the device is not handed out as free."""
    from dask_gpu import DeviceState

    devices = tuple(GPUDevice(index=i, uuid=f"GPU-{i}", name="A100", gpu_type="A100", memory_gb=40.0) for i in range(2))
    live = {"0": DeviceState(key="0", utilization_pct=97.0, memory_used_gb=35.0, memory_free_gb=5.0),
            "1": DeviceState(key="1", utilization_pct=0.0, memory_used_gb=0.5, memory_free_gb=39.5)}
    alloc = DeviceAllocator(devices, live=lambda: live)
    assert alloc.acquire("a", GPURequest(gpus=0.5, gpu_memory_gb=16), timeout=0)[0].key == "1"
    try:
        alloc.acquire("c", GPURequest(gpus=1, gpu_memory_gb=30), timeout=0)
        raise AssertionError("device 0 has 5 GB free but was given to a 30 GB task")
    except DeviceUnavailable:
        pass


def test_declared_devices_have_no_live_state():
    from dask_gpu.worker.live import sample
    from dask_gpu.inventory import declared_worker_inventories

    assert sample(declared_worker_inventories("2 GPUs, 80 GB, H100")[0]) is None


@settings(max_examples=300, deadline=None)
@given(hosts=st.lists(devices_st, min_size=1, max_size=4), request=request_st)
def test_feasibility_agrees_with_what_an_idle_worker_can_hold(hosts, request):
    """Infeasible fails fast exactly when no idle worker of the multi-host cluster could take the request."""
    from dask_gpu import InfeasibleRequest, eligible_workers

    inventories = {f"host-{i}": WorkerInventory(devices=devices) for i, devices in enumerate(hosts)}
    could = set()
    for name, inv in inventories.items():
        try:
            DeviceAllocator(inv.devices).acquire("probe", request, timeout=0)
            could.add(name)
        except DeviceUnavailable:
            pass
    try:
        got = set(eligible_workers(request, inventories))
    except InfeasibleRequest:
        assert could == set()
        return
    if could:
        assert got == could
    else:  # wider than every worker: a gang over whole workers that together hold it
        assert request.gang() and sum(request.fitting(inventories[w]) for w in got) >= request.gpus
