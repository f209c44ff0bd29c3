"""GPU machine check: NVML discovery, LocalGPUCluster on real devices, and what each task's subprocess sees.

On a host with NVIDIA GPUs:

    .venv/bin/python bench/gpu_check.py

discovers the devices through NVML, starts a LocalGPUCluster on them, and runs
tasks (1 GPU each, all GPUs at once, two half-GPU tasks) whose subprocess asks
the CUDA driver (libcuda, through ctypes: no torch needed) which devices it
can see. Each row passes when the subprocess sees exactly the devices the task
was given. Prints a pass/fail table and exits 1 on any failure, 2 when NVML
finds no GPU.
"""

from __future__ import annotations

import json
import sys
import time

from distributed import Client

import dask_gpu
from dask_gpu import GPURequest, LocalGPUCluster, nvml_inventory

# Runs in the task's subprocess: the CUDA driver honours CUDA_VISIBLE_DEVICES, nvidia-smi does not.
CUDA_PROBE = r"""
import ctypes, json
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0, "cuInit failed"
n = ctypes.c_int()
cuda.cuDeviceGetCount(ctypes.byref(n))
uuids = []
for i in range(n.value):
    dev = ctypes.c_int()
    cuda.cuDeviceGet(ctypes.byref(dev), i)
    raw = (ctypes.c_ubyte * 16)()
    cuda.cuDeviceGetUuid(raw, dev)
    h = bytes(raw).hex()
    uuids.append(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
print(json.dumps(uuids))
"""


def probe(_: int) -> dict:
    held = dask_gpu.current_devices()
    out = dask_gpu.run_subprocess([sys.executable, "-c", CUDA_PROBE], capture_output=True, text=True, timeout=120)
    seen = json.loads(out.stdout) if out.returncode == 0 else None
    return {"given": [d.uuid for d in held], "keys": [d.key for d in held], "visible": dask_gpu.gpu_env()["CUDA_VISIBLE_DEVICES"],
            "seen": seen, "error": out.stderr.strip()[-300:] if out.returncode else ""}


def main() -> int:
    inventory = nvml_inventory()
    if inventory is None:
        print("NVML finds no NVIDIA GPU on this host: nothing to check (the tests cover declared inventories)")
        return 2
    print(f"NVML: {inventory.describe()}")
    for d in inventory.devices:
        print(f"  {d.key:>5}  {d.uuid}  {d.name}  {d.memory_gb:g} GB  type={d.gpu_type}")
    n = len(inventory.devices)
    cases = [(f"1 GPU, task {i}", GPURequest(gpus=1)) for i in range(n)]
    if n > 1:
        cases.append((f"all {n} GPUs", GPURequest(gpus=n)))
    cases += [(f"half GPU, task {i}", GPURequest(gpus=0.5)) for i in range(2)]
    rows, failures = [], 0
    with LocalGPUCluster() as cluster, Client(cluster, set_as_default=False) as client:
        resources = next(iter(client.scheduler_info()["workers"].values()))["resources"]
        print(f"worker resources: {resources}")
        print(f"live state: {dask_gpu.cluster_states(client)}")
        t0 = time.time()
        futures = [dask_gpu.submit(client, probe, i, request=req) for i, (_, req) in enumerate(cases)]
        for (name, _), result in zip(cases, client.gather(futures)):
            ok = result["seen"] is not None and sorted(result["seen"]) == sorted(result["given"])
            failures += not ok
            rows.append((name, ",".join(result["keys"]), result["visible"], len(result["seen"] or []),
                         "PASS" if ok else f"FAIL {result['error']}"))
        print(f"ran {len(cases)} tasks in {time.time() - t0:.1f} s")
    print(f"\n{'case':<18} {'devices':<10} {'CUDA_VISIBLE_DEVICES':<22} {'cuda sees':<10} result")
    for row in rows:
        print(f"{row[0]:<18} {row[1]:<10} {row[2]:<22} {row[3]:<10} {row[4]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
