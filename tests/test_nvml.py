"""NVML reading against a stand-in for the `pynvml` module (no NVIDIA driver on this machine).

The stand-in implements the few NVML calls dask_gpu makes, with NVML's
signatures, for a host with one whole H100 and one A100 split into two MIG
instances. The same code path runs against the real library on a GPU host
(bench/gpu_check.py).
"""

from __future__ import annotations

import sys
import types

import pytest

from dask_gpu import GPURequest, gpu_env, nvml_inventory
from dask_gpu.worker.allocator import DeviceAllocator
from dask_gpu.worker.live import sample

GiB = 2**30


class _Mem:
    def __init__(self, total: float, used: float) -> None:
        self.total, self.used, self.free = total * GiB, used * GiB, (total - used) * GiB


def fake_pynvml() -> types.ModuleType:
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    gpus = [
        {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-aaaa", "mem": _Mem(79.6, 1.0), "mig": None, "util": 12},
        {"name": "NVIDIA A100-SXM4-40GB", "uuid": "GPU-bbbb", "mem": _Mem(39.4, 0.0), "util": 0,
         "mig": [{"uuid": "MIG-1111", "mem": _Mem(19.5, 2.0)}, {"uuid": "MIG-2222", "mem": _Mem(19.5, 0.0)}]},
    ]
    m.NVMLError = NVMLError
    m.NVML_DEVICE_MIG_ENABLE = 1
    m.nvmlInit = lambda: None
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = lambda i: ("gpu", i)
    m.nvmlDeviceGetName = lambda h: gpus[h[1]]["name"]
    m.nvmlDeviceGetUUID = lambda h: gpus[h[1]]["uuid"] if h[0] == "gpu" else gpus[h[1]]["mig"][h[2]]["uuid"]
    m.nvmlDeviceGetMemoryInfo = lambda h: gpus[h[1]]["mem"] if h[0] == "gpu" else gpus[h[1]]["mig"][h[2]]["mem"]

    def mig_mode(h):
        if gpus[h[1]]["mig"] is None:
            raise NVMLError("Not Supported")
        return (1, 1)

    m.nvmlDeviceGetMigMode = mig_mode
    m.nvmlDeviceGetMaxMigDeviceCount = lambda h: 7
    m.nvmlDeviceGetMigDeviceHandleByIndex = lambda h, k: ("mig", h[1], k) if k < len(gpus[h[1]]["mig"]) else (_ for _ in ()).throw(NVMLError("Not Found"))
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=gpus[h[1]]["util"], memory=0)
    return m


@pytest.fixture
def nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_whole_gpus_and_mig_instances_are_devices(nvml):
    inv = nvml_inventory()
    assert inv is not None and inv.source == "nvml"
    assert [(d.key, d.gpu_type, d.memory_gb, d.uuid) for d in inv.devices] == [
        ("0", "H100", 79.6, "GPU-aaaa"), ("1:0", "A100", 19.5, "MIG-1111"), ("1:1", "A100", 19.5, "MIG-2222")]
    # CUDA wants the physical index for a whole GPU and the UUID for a MIG instance.
    assert gpu_env(inv.devices, base={})["CUDA_VISIBLE_DEVICES"] == "0,MIG-1111,MIG-2222"


def test_worker_cuda_visible_devices_restricts_the_inventory(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert [d.key for d in nvml_inventory().devices] == ["1:0", "1:1"]


def test_live_state_and_placement_on_it(nvml):
    inv = nvml_inventory()
    states = sample(inv)
    assert states["0"].utilization_pct == 12.0 and states["0"].memory_used_gb == 1.0
    assert states["1:0"].utilization_pct is None and states["1:0"].memory_free_gb == 17.5
    alloc = DeviceAllocator(inv.devices, live=lambda: sample(inv))
    # 18 GB fits a MIG slice by size, but slice 0 has only 17.5 GB free: slice 1 it is.
    assert alloc.acquire("t", GPURequest(gpus=1, gpu_memory_gb=18, gpu_type="A100"), timeout=0)[0].key == "1:1"
