"""What the cluster's queue has waiting, and which workers hold nothing: read on the scheduler, for a scaler.

`backlog_on_scheduler` runs on the scheduler (`client.run_on_scheduler`, which on a TLS cluster only the holder of
the client certificate may call) and only reads the queue plugin's books: nothing is changed there.
"""

from __future__ import annotations

import time
from typing import Any

from dask_gpu.scheduler.devices import UNITS
from dask_gpu.scheduler.queue import PLUGIN_NAME


def backlog_on_scheduler(dask_scheduler: Any) -> dict[str, Any]:
    """The waiting runs (tenant, GPUs, gang width, types) and each worker (by name): its GPUs, whether it holds
    anything now (a run, a fraction, a warm body, any Dask task), the room left on its shared devices (a share of
    each), and the time of this answer."""
    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    workers: dict[str, dict[str, Any]] = {}
    busy_addresses: set[str] = set()
    waiting: list[dict[str, Any]] = []
    if plugin is not None:
        for jid, (_, job) in plugin.waiters.items():
            spec = plugin.specs.get(jid)
            share = getattr(spec, "share", 0.0) if spec is not None else 0.0
            types = getattr(spec, "types", None) if spec is not None else None
            waiting.append({"tenant": job.tenant, "gpus": share or job.gpus, "width": job.width,
                            "types": list(types) if types else None})
        for run, _ in plugin.running.values():
            busy_addresses.update(plugin.addresses[h] for h in run.hosts)
        busy_addresses.update(f[0] for f in plugin.fractions.values())
        busy_addresses.update(w["worker"] for w in plugin.warm_status())
    for address, ws in dask_scheduler.workers.items():
        busy = address in busy_addresses or bool(ws.processing)
        # room left on its shared devices: waiting fractions the queue places there need no new job
        room = [round(1.0 - d.share / UNITS, 6) for d in (plugin.devices.get(address, ()) if plugin is not None else ())
                if d.fractions and d.share < UNITS]
        workers[str(ws.name)] = {"address": address, "gpus": ws.resources.get("GPU", 0), "busy": busy, "room": room}
    return {"queue": plugin is not None, "waiting": waiting, "workers": workers, "at": time.time()}


__all__ = ["backlog_on_scheduler"]
