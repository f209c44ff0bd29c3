"""GPU machine check: NVML discovery, LocalGPUCluster on real devices, and what each task's subprocess sees.

On a host with NVIDIA GPUs:

    .venv/bin/python bench/gpu_check.py

discovers the devices through NVML, starts a LocalGPUCluster on them, and runs
tasks (1 GPU each, all GPUs at once, two half-GPU tasks) whose subprocess asks
the CUDA driver (libcuda, through ctypes: no torch needed) which devices it
can see. Each row passes when the subprocess sees exactly the devices the task
was given. Then, run as root with bubblewrap (how a GPU host's worker runs), it
checks the isolation of dask_gpu.isolation on the real devices: one isolated
body per GPU (its own UID, namespaces, and only its own /dev/nvidiaN node),
whose CUDA driver must see its own GPU with CUDA_VISIBLE_DEVICES set, at most
that one with CUDA_VISIBLE_DEVICES removed (ConstrainDevices), and which
cannot open any other GPU's node. Prints a pass/fail table and exits 1 on any
failure, 2 when NVML finds no GPU.
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


def isolated_probe(own: int, others: list[int]) -> dict:
    """In an isolated body: what the CUDA driver sees with and without CUDA_VISIBLE_DEVICES, and which GPU nodes open."""
    import os
    import subprocess

    def cuda(env: dict) -> list | str:
        out = subprocess.run([sys.executable, "-c", CUDA_PROBE], capture_output=True, text=True, timeout=120, env=env)
        return json.loads(out.stdout) if out.returncode == 0 else f"error: {out.stderr.strip()[-200:]}"

    bare = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    opened = []
    for j in others:
        try:
            os.close(os.open(f"/dev/nvidia{j}", os.O_RDWR))
            opened.append(j)
        except OSError:
            pass
    return {"uid": os.getuid(), "with": cuda(dict(os.environ)), "without": cuda(bare), "opened_others": opened,
            "nodes": sorted(d for d in os.listdir("/dev") if d.startswith("nvidia"))}


def isolated_check(inventory) -> int:
    """Isolated bodies of one tenant on each GPU in turn, twice, through its zygote in the worker's sandbox (as
    dask_gpu.worker.plugin builds it): each sees and opens exactly its own device."""
    import os
    import tempfile

    import cloudpickle

    from dask_gpu.body.code import code_digest
    from dask_gpu.isolation import IsolationSettings, can_isolate, devices, filesystem
    from dask_gpu.framing import recv_msg, send_msg
    from dask_gpu.worker.zygote import Zygote

    why = can_isolate(IsolationSettings())
    if why:
        print(f"\nisolation: not checked ({why})")
        return 0
    if __name__ != "__main__":  # imported: send the probe by value, as a script's functions are
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    whole = [d for d in inventory.devices if d.mig is None]
    indices = [d.index for d in whole]
    bodies = tempfile.mkdtemp(prefix="gpu-check-bodies-")
    os.chmod(bodies, 0o711)
    zygote = Zygote(tenant="gpu-check", sandbox=filesystem.sandbox_argv(
        "/usr/bin/bwrap", read_only=filesystem.code_paths(sys.path), hide=[], bodies_dir=bodies,
        devices=devices.sandbox_nodes("/dev", indices)))
    failures = 0
    print(f"\n{'isolated body':<16} {'uid':<7} {'nodes':<28} {'cuda (CVD set)':<16} {'cuda (CVD unset)':<17} result")
    try:
        # Every GPU twice, in turn, through one tenant's zygote: a body must still find its own node after a body of
        # its tenant ran on another GPU (the nodes of the /dev its zygote's bodies share are never removed).
        for n, d in enumerate(whole + whole):
            others = [i for i in indices if i != d.index]
            payload = cloudpickle.dumps(isolated_probe) + cloudpickle.dumps(((d.index, others), {}))
            sock = zygote.connect(["cloudpickle"], {"uid": 20000 + n, "workdir": f"check-{n}"})
            json.loads(recv_msg(sock))
            send_msg(sock, json.dumps({"env": gpu_env_for(d), "code_digest": code_digest(isolated_probe),
                                       "devices": [d.model_dump()]}).encode())
            send_msg(sock, payload)
            meta, blob = json.loads(recv_msg(sock)), recv_msg(sock)
            sock.close()
            if not meta.get("ok"):
                failures += 1
                print(f"GPU {d.index:<12} FAIL {meta.get('error_message')}")
                continue
            r = cloudpickle.loads(blob)
            ok = (r["with"] == [d.uuid] and isinstance(r["without"], list) and r["without"] in ([], [d.uuid])
                  and not r["opened_others"] and r["uid"] == 20000 + n)
            failures += not ok
            print(f"GPU {d.index:<12} {r['uid']:<7} {','.join(r['nodes']):<28} {str(len(r['with'])):<16} "
                  f"{str(r['without'] if isinstance(r['without'], str) else len(r['without'])):<17} "
                  f"{'PASS' if ok else 'FAIL ' + str(r)}")
    finally:
        zygote.close()
    return failures


def gpu_env_for(device) -> dict:
    return dask_gpu.gpu_env([device], base={})


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
        resources = next(iter(client.sync(client.scheduler.identity, n_workers=-1)["workers"].values()))["resources"]
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
    failures += isolated_check(inventory)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
