"""What a body's own network namespace adds to its start, cold and warm (dask_gpu.isolation.network).

The same trivial body, started by a tenant's isolated zygote (bwrap sandbox, as a root worker runs it) with each
network: `host` (the host's namespace, as before), `none` (a namespace of its own, loopback up) and `pasta` (that,
plus the worker attaching pasta for outbound), interleaved round by round so a busy machine weighs on each alike.
Cold: the zygote handed the body to its first result back (pasta attached in between, as the worker does before it
sends the run). Warm: a second run in the same body (the namespace is already there: nothing to add).

    sudo .venv/bin/python bench/netns.py --bodies 40      # needs root, bubblewrap and pasta
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def _trivial_body() -> int:
    return 1


def measure(n: int) -> dict[str, dict[str, float]]:
    import cloudpickle

    from dask_gpu.body.code import code_digest
    from dask_gpu.framing import recv_msg, send_msg
    from dask_gpu.isolation import IsolationSettings, can_isolate, devices, filesystem, network
    from dask_gpu.worker.zygote import Zygote

    why = can_isolate(IsolationSettings()) or network.unavailable("pasta", IsolationSettings().pasta)
    if why:
        sys.exit(f"bench/netns.py: {why}")
    settings = IsolationSettings()
    bodies = tempfile.mkdtemp(prefix="bench-netns-bodies-")
    os.chmod(bodies, 0o711)
    zygote = Zygote(tenant="bench", sandbox=filesystem.sandbox_argv(
        settings.bwrap, read_only=filesystem.code_paths(sys.path), hide=[], bodies_dir=bodies,
        devices=devices.sandbox_nodes("/dev", [])))
    payload = cloudpickle.dumps(_trivial_body) + cloudpickle.dumps(((), {}))
    header = json.dumps({"env": {}, "code_digest": code_digest(_trivial_body), "devices": []}).encode()
    netns_dir = tempfile.mkdtemp(prefix="bench-netns-")

    def run(sock) -> None:
        send_msg(sock, header)
        send_msg(sock, payload)
        meta = json.loads(recv_msg(sock))
        recv_msg(sock)
        assert meta["ok"], meta

    def once(kind: str, i: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        sock = zygote.connect(["cloudpickle"], {"uid": 24500 + i % 400, "workdir": f"{kind}-{i}", "network": kind})
        pid = json.loads(recv_msg(sock))["pid"]
        outbound = network.attach(pid, f"bench-{i}", netns_dir, settings.pasta) if kind == "pasta" else None
        run(sock)
        cold = time.perf_counter() - t0
        t1 = time.perf_counter()
        run(sock)
        warm = time.perf_counter() - t1
        sock.close()
        if outbound is not None:
            outbound.close()
        return cold, warm

    kinds = ("host", "none", "pasta")
    samples: dict[str, dict[str, list[float]]] = {k: {"cold": [], "warm": []} for k in kinds}
    try:
        for i in range(2):  # the zygote started, its imports done
            for kind in kinds:
                once(kind, i)
        for i in range(n):
            for kind in kinds:
                cold, warm = once(kind, 100 + i)
                samples[kind]["cold"].append(cold)
                samples[kind]["warm"].append(warm)
    finally:
        zygote.close()
    return {k: {w: statistics.median(v) for w, v in s.items()} for k, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bodies", type=int, default=40, help="bodies per network (interleaved)")
    args = parser.parse_args()
    got = measure(args.bodies)
    print(f"one body, {args.bodies} per network, medians (isolated zygote, no Dask; load {os.getloadavg()[0]:.1f}):")
    for kind, m in got.items():
        print(f"  {kind:6s} cold {1000 * m['cold']:8.2f} ms   warm {1000 * m['warm']:7.2f} ms")
    for kind in ("none", "pasta"):
        print(f"  {kind} adds {1000 * (got[kind]['cold'] - got['host']['cold']):.2f} ms cold, "
              f"{1000 * (got[kind]['warm'] - got['host']['warm']):.2f} ms warm, to `host`")


if __name__ == "__main__":
    main()
