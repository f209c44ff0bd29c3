import pytest

from dask_gpu import DECLARED_ENV, GPURequest, InfeasibleRequest, InventorySpecError, discover, eligible_workers, parse_declared
from dask_gpu.inventory import declared_worker_inventories, gpu_type_from_name, nvml_inventory


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("2 workers x 2 GPUs, 80 GB, H100", [(2, 2, "H100", 80.0)]),
        ("1 worker x 1 GPU, 24 GB, a10", [(1, 1, "A10", 24.0)]),
        ("4 GPUs, 24 GB, A10", [(1, 4, "A10", 24.0)]),
        ("1 worker × 8 GPUs, 192 GB, MI300X; 3 workers x 1 GPU, 24.5 gb, L4", [(1, 8, "MI300X", 192.0), (3, 1, "L4", 24.5)]),
        ("  2 GPUS ,80GB,  h100 ;", [(1, 2, "H100", 80.0)]),
    ],
)
def test_parse_declared(spec, expected):
    got = [(g.workers, g.gpus, g.gpu_type, g.memory_gb) for g in parse_declared(spec)]
    assert got == expected


# The typos a new user made (issue 17), and others: each is an error that says what was expected where,
# shows the grammar and an example; none is read as something else.
TYPOS = [
    ("24 GB, A10", "expected 'GPUs' after the count 24 but found 'GB'"),  # was: 24 A10s of 80 GB
    ("4 A10", "expected 'GPUs' after the count 4 but found 'A10'"),  # was: 80 GB each
    ("2 GPUs, 80 GB", "then the GPU type: it is required"),  # was: silently H100
    ("2 workers, 2 GPUs, 80 GB, H100", "'2 workers' must be followed by 'x'"),  # was: one worker
    ("2 GPUs, 0 GB, H100", "must be more than 0 GB"),  # was: a raw pydantic error
    ("0 GB", "expected 'GPUs' after the count 0 but found 'GB'"),
    ("2 GPUs", "then the memory of each GPU: it is required"),
    ("2x2 H100 80GB", "write the counts out"),
    ("2 GPUs, 80 GB, H100 A100", "one type per group"),
    ("2.5 GPUs, 80 GB, H100", "expected a whole number"),
    ("0 GPUs, 80 GB, H100", "at least 1"),
    ("H100 lots", "expected a whole number"),
    ("2 GPUs, 80 GB, H100;; 1 GPU, 24 GB, A10", "empty group"),
    ("", "is empty"),
]


@pytest.mark.parametrize("spec, why", TYPOS)
def test_a_spec_that_does_not_parse_exactly_is_an_error_with_the_grammar(spec, why):
    with pytest.raises(InventorySpecError) as err:
        parse_declared(spec, source="--declared")
    message = str(err.value)
    assert message.startswith(f"--declared {spec!r}") and why in message
    assert "[WORKERS workers x] GPUS GPUs, MEMORY GB, TYPE" in message and "e.g. '2 GPUs, 80 GB, H100'" in message


def test_declared_worker_inventories_have_distinct_indices():
    invs = declared_worker_inventories("2 workers x 3 GPUs, 40 GB, A100")
    assert len(invs) == 2
    assert [d.index for d in invs[0].devices] == [0, 1, 2]
    assert invs[0].resources() == {"GPU": 3.0, "GPU-A100": 3.0, "GPU-MEMORY-GB": 120.0}
    (group,) = parse_declared("2 workers x 3 GPUs, 40 GB, A100")
    assert parse_declared(group.spec())[0] == group.model_copy(update={"workers": 1})  # what each local worker gets


def test_discover_names_the_setting_that_was_wrong(monkeypatch):
    monkeypatch.setenv(DECLARED_ENV, "2 GPUs, 24 GB, A10")
    inv = discover()
    assert inv.source == "declared" and inv.describe() == "2 x A10 24 GB"
    monkeypatch.setenv(DECLARED_ENV, "2 workers x 2 GPUs, 80 GB, H100")
    with pytest.raises(InventorySpecError, match="one worker"):
        discover()
    monkeypatch.setenv(DECLARED_ENV, "4 A10")
    with pytest.raises(InventorySpecError, match=r"^DASK_GPU_DECLARED '4 A10': expected 'GPUs'"):
        discover()
    with pytest.raises(InventorySpecError, match=r"^declared= '24 GB, A10'"):
        discover("24 GB, A10")


def test_each_entry_point_names_the_setting_that_was_wrong(monkeypatch):
    """dask-gpu-worker --declared, DASK_GPU_DECLARED, LocalGPUCluster(declared=) and aisched inventory --declared."""
    from typer.testing import CliRunner

    from aisched_prefect.cli import app
    from dask_gpu import LocalGPUCluster
    from dask_gpu.worker.cli import main as worker_main

    monkeypatch.delenv(DECLARED_ENV, raising=False)
    with pytest.raises(SystemExit) as out:  # fails before it connects anywhere
        worker_main(["tcp://127.0.0.1:1", "--declared", "2 GPUs, 80 GB"])
    assert str(out.value.code).startswith("dask-gpu-worker: --declared '2 GPUs, 80 GB': expected ','")
    monkeypatch.setenv(DECLARED_ENV, "2 workers, 2 GPUs, 80 GB, H100")
    with pytest.raises(SystemExit) as out:
        worker_main(["tcp://127.0.0.1:1"])
    assert str(out.value.code).startswith("dask-gpu-worker: DASK_GPU_DECLARED '2 workers, 2 GPUs, 80 GB, H100'")
    with pytest.raises(InventorySpecError, match=r"^DASK_GPU_DECLARED '2 workers, 2 GPUs"):
        LocalGPUCluster()
    with pytest.raises(InventorySpecError, match=r"^LocalGPUCluster\(declared=...\) '4 A10'"):
        LocalGPUCluster(declared="4 A10")
    monkeypatch.delenv(DECLARED_ENV)
    bad = CliRunner().invoke(app, ["inventory", "--declared", "24 GB, A10"])
    assert bad.exit_code == 2 and "--declared '24 GB, A10': expected 'GPUs'" in bad.output
    # The multi-worker example the docs give: each worker's devices.
    good = CliRunner().invoke(app, ["inventory", "--declared", "2 workers x 2 GPUs, 80 GB, H100; 1 worker x 1 GPU, 24 GB, A10"])
    assert good.exit_code == 0, good.output
    assert good.output.count("2 x H100 80 GB") == 2 and "worker 2: source declared; 1 x A10 24 GB" in good.output


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
    invs = {"w1": declared_worker_inventories("2 GPUs, 80 GB, H100")[0],
            "w2": declared_worker_inventories("1 GPU, 24 GB, A10")[0]}
    assert eligible_workers(GPURequest(gpus=1), invs) == ["w1", "w2"]
    assert eligible_workers(GPURequest(gpus=1, gpu_memory_gb=40), invs) == ["w1"]
    assert eligible_workers(GPURequest(gpus=1, gpu_type="a10"), invs) == ["w2"]
    with pytest.raises(InfeasibleRequest, match=r"gpus=3.*largest worker w1 has 2 x H100 80 GB"):
        eligible_workers(GPURequest(gpus=3), invs)  # wider than each: no hosts= spreads 3 evenly here
    with pytest.raises(InfeasibleRequest, match=r"gpus=3, gpu_type='H100'.*largest worker w1 has 2 x H100"):
        eligible_workers(GPURequest(gpus=3, gpu_type="H100"), invs)
    two = {**invs, "w3": declared_worker_inventories("1 GPU, 24 GB, A10")[0]}
    with pytest.raises(InfeasibleRequest, match=r"did not ask for several hosts.*Fix: ask for hosts=2 \(gpus=2, hosts=2"):
        eligible_workers(GPURequest(gpus=2, gpu_type="A10"), two)  # two 1-GPU A10 workers: only as two processes
    assert eligible_workers(GPURequest(gpus=2, gpu_type="A10", hosts=2), two) == ["w2", "w3"]
    with pytest.raises(InfeasibleRequest, match=r"gpus=4.*fits no worker.*largest worker w1 has 2 x H100 80 GB"):
        eligible_workers(GPURequest(gpus=4), invs)
    with pytest.raises(InfeasibleRequest, match=r"gpus=3.*largest worker w1 has 2 x H100 80 GB"):
        eligible_workers(GPURequest(gpus=3, hosts=1), invs)
    with pytest.raises(InfeasibleRequest, match=r"it needs 2 workers with 2 fitting GPUs each"):
        eligible_workers(GPURequest(gpus=4, hosts=2), invs)
    assert eligible_workers(GPURequest(gpus=2, hosts=2), invs) == ["w1", "w2"]
    with pytest.raises(InfeasibleRequest, match="gpu_type='L4'"):
        eligible_workers(GPURequest(gpus=1, gpu_type="L4"), invs)
