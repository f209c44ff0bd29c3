import threading
import time

import pytest

from dask_gpu import DeviceUnavailable, GPURequest
from dask_gpu.worker.allocator import DeviceAllocator
from dask_gpu.inventory import declared_worker_inventories


def test_disjoint_devices_under_threads():
    alloc = DeviceAllocator(declared_worker_inventories("4 GPUs, 80 GB, H100")[0].devices)
    held_now: dict[int, str] = {}
    violations = []
    lock = threading.Lock()

    def task(i: int) -> None:
        key = f"t{i}"
        devices = alloc.acquire(key, GPURequest(gpus=1 + i % 2), timeout=10)
        with lock:
            for d in devices:
                if d.index in held_now:
                    violations.append((key, d.index, held_now[d.index]))
                held_now[d.index] = key
        time.sleep(0.01)
        with lock:
            for d in devices:
                del held_now[d.index]
        alloc.release(key)

    threads = [threading.Thread(target=task, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert violations == []
    assert alloc.holders() == {}


def test_acquire_is_all_or_nothing_and_times_out():
    alloc = DeviceAllocator(declared_worker_inventories("2 GPUs, 80 GB, H100")[0].devices)
    alloc.acquire("a", GPURequest(gpus=1))
    with pytest.raises(DeviceUnavailable, match="no gpus=2 free"):
        alloc.acquire("b", GPURequest(gpus=2), timeout=0.2)
    assert alloc.holders() == {"a": ["0"]}
    alloc.release("a")
    assert [d.index for d in alloc.acquire("b", GPURequest(gpus=2), timeout=0.2)] == [0, 1]
