import pytest

from dask_gpu import DECLARED_ENV, GPURequest, InfeasibleRequest, InventorySpecError, discover, eligible_workers, parse_declared
from dask_gpu.inventory import declared_worker_inventories, gpu_type_from_name, nvml_inventory


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("2 workers x 2 GPUs, 80 GB, H100", [(2, 2, "H100", 80.0)]),
        ("2x2 H100 80GB", [(2, 2, "H100", 80.0)]),
        ("4 A10 24GB", [(1, 4, "A10", 24.0)]),
        ("1x8 MI300 192 GB; 3 x 1 L4 24gb", [(1, 8, "MI300", 192.0), (3, 1, "L4", 24.0)]),
        ("2 GPUs", [(1, 2, "H100", 80.0)]),
    ],
)
def test_parse_declared(spec, expected):
    got = [(g.workers, g.gpus, g.gpu_type, g.memory_gb) for g in parse_declared(spec)]
    assert got == expected


@pytest.mark.parametrize("spec", ["", "H100 lots", "2x2 H100 A100 80GB"])
def test_bad_declared_spec_names_the_fix(spec):
    with pytest.raises(InventorySpecError, match="declared GPU inventory"):
        parse_declared(spec)


def test_declared_worker_inventories_have_distinct_indices():
    invs = declared_worker_inventories("2x3 A100 40GB")
    assert len(invs) == 2
    assert [d.index for d in invs[0].devices] == [0, 1, 2]
    assert invs[0].resources() == {"GPU": 3.0, "GPU-A100": 3.0, "GPU-MEMORY-GB": 120.0}


def test_discover_reads_env_and_refuses_multi_worker_spec(monkeypatch):
    monkeypatch.setenv(DECLARED_ENV, "2 GPUs, 24 GB, A10")
    inv = discover()
    assert inv.source == "declared" and inv.describe() == "2 x A10 24 GB"
    monkeypatch.setenv(DECLARED_ENV, "2 workers x 2 GPUs")
    with pytest.raises(InventorySpecError, match="one worker"):
        discover()


def test_nvml_absent_means_no_inventory_here():
    # This machine has no NVIDIA driver; on a GPU host the device tool's check covers NVML.
    inv = nvml_inventory()
    assert inv is None or inv.source == "nvml"


@pytest.mark.parametrize(
    "name, gpu_type",
    [("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA A100-SXM4-40GB", "A100"), ("Tesla T4", "T4"),
     ("NVIDIA L4", "L4"), ("NVIDIA A10", "A10"), ("NVIDIA H200", "H200")],
)
def test_gpu_type_from_nvml_name(name, gpu_type):
    assert gpu_type_from_name(name) == gpu_type


def test_eligible_workers_and_fail_fast_message():
    invs = {"w1": declared_worker_inventories("2 H100 80GB")[0], "w2": declared_worker_inventories("1 A10 24GB")[0]}
    assert eligible_workers(GPURequest(gpus=1), invs) == ["w1", "w2"]
    assert eligible_workers(GPURequest(gpus=1, gpu_memory_gb=40), invs) == ["w1"]
    assert eligible_workers(GPURequest(gpus=1, gpu_type="a10"), invs) == ["w2"]
    with pytest.raises(InfeasibleRequest, match=r"gpus=3.*largest worker w1 has 2 x H100 80 GB"):
        eligible_workers(GPURequest(gpus=3), invs)
    with pytest.raises(InfeasibleRequest, match="gpu_type='L4'"):
        eligible_workers(GPURequest(gpus=1, gpu_type="L4"), invs)
