"""The cluster's queue and warm bodies: a run goes to an idle warm body of its key before a cold one starts.

A body that stays warm after its run (dask_gpu.worker.bodies) keeps its device share: in the queue's books its run's
place passes to a *holder* (a negative id where the run's id was: the device's share and memory, a whole run's
GPUs in the policy's state), so nothing else is placed there while its model sits in GPU memory. A run entered
with the same key (`warm`: tenant, principal, code, request; the worker checks it again against the signed ticket)
takes the holder's place as it is, with the body's id in its answer (`body`), before any fresh device is opened:
a 10,000-shard map at quarter GPUs on 4 GPUs runs in at most 16 bodies. Idle holders are the first thing given
up: when a run of another key waits and finds no room, the oldest idle holders where it could run are evicted
(their workers end the bodies) before the policy's next pass, and before any running work is preempted. A body
its worker ended (its keep-warm time passed, its authority ended, it died) is dropped from the books on the
worker's word (`gpu-queue-cold`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from dask_gpu.scheduler.devices import Spec
from dask_gpu.policies.interface import Job, Running

logger = logging.getLogger("distributed.dask_gpu")
EVICT_LOOK = 16  # waiters looked at per pass when deciding what to evict (the first ones entered)


@dataclass(eq=False)
class Warm:
    """An idle warm body, as the queue's books hold it: where, of which key, and the place it keeps."""

    body: str
    key: str
    tenant: str
    address: str
    host: int
    hid: int  # its id in the device books (negative)
    since: float
    gpus: int = 0  # whole GPUs it keeps (0: a fraction)
    device: Any = None  # a fraction's device, its units and GB
    units: int = 0
    gb: float = 0.0
    run: Running | None = None  # a whole body's place in the policy's state
    devices: list[str] = field(default_factory=list)


def _gpus(group: list[Warm]) -> int:
    """Whole GPUs that ending this group of idle bodies gives back: a whole body's, or one shared device."""
    return group[0].gpus if group[0].run is not None else 1


class WarmPlacement:
    """The queue plugin's part that keeps warm bodies' places and hands them to runs of their key (a mixin of
    GPUQueuePlugin: it works on that plugin's books)."""

    def _warm_init(self) -> None:
        self.warm: dict[str, Warm] = {}  # idle warm bodies by body id
        self.warm_keys: dict[int, str] = {}  # job id -> the warm key it entered with (waiting or running)
        self.idle_by_key: dict[str, list[str]] = {}  # key -> idle bodies, most recently idle last
        self.waiting_by_key: dict[str, deque[int]] = {}  # key -> waiting job ids (stale ones skipped as found)
        self._hids = itertools.count(-1, -1)
        self.evictions = 0

    # -- a run ends warm -------------------------------------------------------------------
    def _park(self, jid: int, worker: str, body: str, keep: float) -> bool:
        """The run `jid` ended on `worker` and its body stays warm: its place passes to a holder. False: not a run of
        a key (it is freed as usual)."""
        key = self.warm_keys.pop(jid, None)
        if not key or body in self.warm:
            return False
        now = time.time()
        hid = next(self._hids)
        if jid in self.running:
            run, _ = self.running.pop(jid)
            self.shapes.pop(jid, None)
            self.policy.finish([run.job], now)  # the run is over: the policy learns its real time
            holder = Running(Job(id=hid, tenant=run.job.tenant, gpus=run.job.gpus, submit=now, estimate=keep,
                                 priority=run.job.priority, hosts=run.job.hosts), run.host, now, run.gang)
            self.state.running.remove(run)
            self.state.running.append(holder)
            assigned = self.assigned.pop(jid, [])
            self.assigned[hid] = assigned
            for address, keys in assigned:
                for d in self.devices.get(address, ()):
                    if d.key in keys and d.whole == jid:
                        d.whole = hid
            w = Warm(body, key, run.job.tenant, self.addresses[run.host], run.host, hid, now, gpus=run.job.gpus,
                     run=holder, devices=[k for _, keys in assigned for k in keys])
        elif jid in self.fractions:
            address, d, units, gb, _ = self.fractions.pop(jid)
            job = self.fraction_runs.pop(jid)[0]
            self.policy.finish([job], now)  # the run is over: the policy learns its real time
            d.fractions.discard(jid)
            d.fractions.add(hid)  # the device stays shared (and its anchor counted) while the body keeps its share
            w = Warm(body, key, job.tenant, address, self.addresses.index(address), hid, now, device=d, units=units,
                     gb=gb, devices=[d.key])
        else:
            return False
        self.specs.pop(jid, None)
        self.tasks.pop(jid, None)
        self.warm[body] = w
        self.idle_by_key.setdefault(key, []).append(body)
        return True

    # -- a run of a key takes a warm body ------------------------------------------------------
    def _note_waiting(self, jid: int, key: str | None) -> None:
        if key:
            self.warm_keys[jid] = key
            self.waiting_by_key.setdefault(key, deque()).append(jid)

    def _reuse(self, job: Job, client: str, spec: Any) -> bool:
        """Start `job` in an idle warm body of its key (on a host it allows, keeping the same place); False if none."""
        key = self.warm_keys.get(job.id)
        bodies = self.idle_by_key.get(key or "")
        if not bodies:
            return False
        for body in reversed(bodies):  # the most recently idle: the others may run out their keep-warm time
            w = self.warm[body]
            if job.hosts is not None and w.host not in job.hosts:
                continue
            if spec.share:
                if w.device is None or (w.units, w.gb) != spec.reserve(w.device):
                    continue
            elif w.gpus != job.gpus or w.run is None or w.run.gang:
                continue
            self._forget_warm(w)
            self._book_start(job)  # the policy counts it started (it did not choose it)
            now = time.time()
            if w.device is not None:
                d = w.device
                d.fractions.discard(w.hid)
                d.fractions.add(job.id)
                self.fractions[job.id] = (w.address, d, w.units, w.gb, client)
                self.fraction_runs[job.id] = (job, now, spec.share)
                shares: list[float] = [spec.share]
            else:
                assert w.run is not None
                self.state.running.remove(w.run)
                run = Running(job, w.host, now, w.run.gang)
                self.state.running.append(run)
                self.running[job.id] = (run, client)
                self.assigned[job.id] = self.assigned.pop(w.hid, [])
                for d in self.devices.get(w.address, ()):
                    if d.whole == w.hid:
                        d.whole = job.id
                shares = [job.gpus]
            self._answer(job.id, {"workers": [w.address], "devices": [w.devices], "shares": shares, "body": body})
            return True
        return False

    def _reuse_waiting(self) -> None:
        """Waiting runs of keys that have idle warm bodies start in them (before anything else of this pass)."""
        for key in [k for k, b in self.idle_by_key.items() if b]:
            line = self.waiting_by_key.get(key)
            while line and self.idle_by_key.get(key):
                jid = line[0]
                if jid not in self.waiters:
                    line.popleft()  # started or gone meanwhile
                    continue
                client, job = self.waiters[jid]
                if not self._reuse(job, client, self.specs.get(jid) or Spec()):
                    break  # its idle bodies are where it may not run: the next pass, or a fresh device
                line.popleft()
                self.specs.pop(jid, None)
            if line is not None and not line:
                del self.waiting_by_key[key]

    # -- warm bodies leave ---------------------------------------------------------------------
    def _forget_warm(self, w: Warm) -> None:
        self.warm.pop(w.body, None)
        bodies = self.idle_by_key.get(w.key, [])
        if w.body in bodies:
            bodies.remove(w.body)
        if not bodies:
            self.idle_by_key.pop(w.key, None)

    def _free_warm(self, w: Warm) -> None:
        """Give up a holder's place: its share of a device (and the device, if it empties), or its whole GPUs."""
        self._forget_warm(w)
        if w.device is not None:
            d = w.device
            if w.hid in d.fractions:
                d.fractions.discard(w.hid)
                d.share -= w.units
                d.mem -= w.gb
                if not d.fractions and d.anchor is not None:
                    if d.anchor in self.state.running:
                        self.state.release(d.anchor)
                    d.anchor = None
        elif w.run is not None:
            if w.run in self.state.running:
                self.state.release(w.run)
            for _, keys in self.assigned.pop(w.hid, []):
                for d in self.devices.get(w.address, ()):
                    if d.key in keys and d.whole == w.hid:
                        d.whole = None

    def _cold(self, body: str, worker: str | None) -> None:
        """The worker ended a body the books count as warm: its place is free (only that worker's word counts)."""
        w = self.warm.get(body)
        if w is not None and w.address == worker:
            self._free_warm(w)
            self._dispatch_soon()

    def _warm_worker_gone(self, address: str) -> None:
        for w in [w for w in self.warm.values() if w.address == address]:
            self._forget_warm(w)
            if w.run is not None and w.run in self.state.running:
                self.state.running.remove(w.run)
            self.assigned.pop(w.hid, None)

    def _evict_for_waiting(self) -> bool:
        """Runs wait that find no room, and idle warm bodies of other keys hold room where they could run: end the
        oldest of those bodies (the first thing given up, before any preemption). True if any was evicted."""
        if not self.warm or not self.waiters:
            return False
        chosen: dict[str, Warm] = {}
        for jid, (_, job) in itertools.islice(self.waiters.items(), EVICT_LOOK):
            key = self.warm_keys.get(jid)
            spec = self.specs.get(jid)
            others = sorted((w for w in self.warm.values() if w.body not in chosen and w.key != key
                             and (job.hosts is None or w.host in job.hosts)), key=lambda w: w.since)
            if spec is not None and spec.share:  # a fraction: one device that its idle bodies alone keep busy
                for w in others:
                    d = w.device
                    idle_here = [o for o in others if o.device is d] if d is not None else [w]
                    if d is None or {o.hid for o in idle_here} >= set(d.fractions):
                        chosen.update((o.body, o) for o in idle_here)
                        break
            else:  # whole GPUs: enough on one host it allows, counting what its idle bodies hold there (a whole
                # body's GPUs; a shared device whose only holders are idle bodies: one GPU)
                by_host: dict[int, list[list[Warm]]] = {}
                shared: dict[int, list[Warm]] = {}
                for w in others:
                    if w.run is not None:
                        by_host.setdefault(w.host, []).append([w])
                    elif w.device is not None:
                        shared.setdefault(id(w.device), []).append(w)
                for ws in shared.values():
                    d = ws[0].device
                    if {o.hid for o in ws} >= set(d.fractions) and d.anchor is not None:
                        by_host.setdefault(ws[0].host, []).append(ws)
                for host, groups in by_host.items():
                    free = self.state.free[host]
                    if free + sum(_gpus(g) for g in groups) < job.gpus:
                        continue
                    for g in groups:
                        if free >= job.gpus:
                            break
                        chosen.update((o.body, o) for o in g)
                        free += _gpus(g)
                    break
        if not chosen:
            return False
        by_worker: dict[str, list[str]] = {}
        for w in chosen.values():
            self._free_warm(w)
            by_worker.setdefault(w.address, []).append(w.body)
            self.evictions += 1
        for worker, bodies in by_worker.items():
            msg = {"op": "gpu_end_warm", "bodies": bodies, "reason": "evicted: another run needs its device"}
            if self.scheduler is not None:
                try:
                    asyncio.ensure_future(self.scheduler.broadcast(msg=msg, workers=[worker], on_error="ignore"))
                except RuntimeError:  # no event loop (a test driving the plugin by hand)
                    pass
        logger.info("cluster queue: evicted %d idle warm bod%s for waiting runs", len(chosen),
                    "y" if len(chosen) == 1 else "ies")
        return True

    def warm_status(self) -> list[dict[str, Any]]:
        now = time.time()
        return [{"body": w.body, "tenant": w.tenant, "worker": w.address, "devices": w.devices,
                 "gpus": w.gpus or (w.units / 1_000_000), "idle": now - w.since} for w in self.warm.values()]
