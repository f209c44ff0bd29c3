"""The cluster's queue's books of devices: what a run asks of devices, and what each device holds now."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

from dask_gpu.inventory import WorkerInventory
from dask_gpu.policies.interface import Job, Running
from dask_gpu.request import split

LEARN_SECONDS = 5.0  # how long a run waits for the plugin to learn a new worker's devices

UNITS = 1_000_000  # shares of a device in millionths: no float drift


@dataclass(frozen=True)
class Spec:
    """What a run asks of devices: whole ones (at least `memory` GB each) or a `share` of one (`memory` GB of it)."""

    types: tuple[str, ...] | None = None
    memory: float | None = None
    share: float = 0.0  # 0: whole devices
    width: int = 0

    def type_ok(self, d: "Device") -> bool:
        return self.types is None or d.type.upper() in self.types

    def whole_fits(self, d: "Device") -> bool:
        return self.type_ok(d) and (self.memory is None or d.memory >= self.memory)

    def reserve(self, d: "Device") -> tuple[int, float]:
        """(share units, GB) a fraction takes of `d`."""
        return int(round(self.share * UNITS)), self.memory if self.memory is not None else self.share * d.memory

    def fraction_fits(self, d: "Device") -> bool:
        units, gb = self.reserve(d)
        return (self.type_ok(d) and d.whole is None and d.share + units <= UNITS
                and d.mem + gb <= d.memory + 1e-9)


@dataclass(eq=False)
class Device:
    """One device of a worker, as the queue's books hold it."""

    key: str
    type: str
    memory: float
    whole: int | None = None  # the run that holds it whole
    share: int = 0  # units in use by fractions
    mem: float = 0.0  # GB reserved by fractions
    fractions: set[int] = field(default_factory=set)
    anchor: Running | None = None  # the policy's one-GPU run that keeps a shared device off the whole count

    @property
    def idle(self) -> bool:
        return self.whole is None and not self.fractions


def _device_order(key: str) -> tuple[int, ...]:
    return tuple(int(x) for x in key.split(":") if x.isdigit())




class DevicePlacement:
    """The queue plugin's part that learns each worker's devices and chooses which ones a run gets (a mixin of
    GPUQueuePlugin: it works on that plugin's books)."""

    def _learn_soon(self, address: str) -> None:
        if address not in self._learning and self.scheduler is not None:
            try:
                self._learning[address] = asyncio.ensure_future(self._learn(address))
            except RuntimeError:  # no running event loop (a test driving the plugin by hand)
                pass

    async def _learn(self, address: str) -> None:
        """Ask the worker's GPU plugin for its devices (once per worker address)."""
        try:
            found = await self.scheduler.broadcast(msg={"op": "gpu_inventory"}, workers=[address], on_error="ignore")
        except Exception:  # not a GPU worker, or a scheduler that cannot broadcast: counts only
            return
        answer = found.get(address) if isinstance(found, dict) else None
        if isinstance(answer, dict) and "inventory" in answer and address in self.addresses:
            inv = WorkerInventory.model_validate(answer["inventory"])
            self.devices[address] = [Device(d.key, d.gpu_type, d.memory_gb) for d in inv.devices]
            self.tenant_of[address] = inv.tenant
            self._widen_waiting(address)
            self._dispatch()

    def _widen_waiting(self, address: str) -> None:
        """A worker joined: a waiting run limited to the workers that could hold it when it was admitted may run on
        this one too where its devices hold it (type, memory; a gang: one member's share). Without this a run that
        waits for a worker to come (a Slurm job dask-gpu-slurm submitted for it) would never start there."""
        h = self.addresses.index(address)
        devices = self.devices.get(address, ())
        for jid, (client, job) in list(self.waiters.items()):
            if job.hosts is None or h in job.hosts:
                continue
            spec = self.specs.get(jid, Spec())
            if self.tenant_of.get(address) not in (None, job.tenant):  # a worker started for another tenant
                continue
            need = 1 if spec.share else job.gpus // job.width if job.width > 1 else job.gpus
            if sum(1 for d in devices if (spec.fraction_fits(d) if spec.share else spec.whole_fits(d))) < need:
                continue
            wider = replace(job, hosts=job.hosts | {h})
            self.policy.withdraw([job])
            self.waiters[jid] = (client, wider)
            self._line_up(jid)  # a fraction moves to the line of its new shape
            self.policy.submit(wider, self.state)

    async def _known(self, addresses: list[str]) -> None:
        """Wait (briefly) until the devices of `addresses` are learned."""
        for a in addresses:
            self._learn_soon(a)
        pending = [self._learning[a] for a in addresses if a in self._learning and not self._learning[a].done()]
        if pending:
            await asyncio.wait(pending, timeout=LEARN_SECONDS)

    def _open_fit(self, spec: Spec, hosts: frozenset[int] | None) -> tuple[str, Device] | None:
        """The fullest shared device (of an allowed worker) that still holds the fraction: best fit."""
        best = None
        for h, address in enumerate(self.addresses):
            if hosts is not None and h not in hosts:
                continue
            for d in self.devices.get(address, ()):
                if d.fractions and spec.fraction_fits(d) and (best is None or (d.share, d.mem) > (best[1].share, best[1].mem)):
                    best = (address, d)
        return best

    def _fresh(self, address: str, spec: Spec) -> Device | None:
        """An idle device of `address` that could hold the fraction (the smallest, to keep big ones whole)."""
        idle = [d for d in self.devices.get(address, ()) if d.idle and spec.fraction_fits(d)]
        return min(idle, key=lambda d: (d.memory, d.key)) if idle else None

    def _assign(self, jid: int, holds: tuple[tuple[int, int], ...], gpus: int, spec: Spec) -> tuple[list[list[str]] | None, list[int]]:
        """Which idle devices of each host a whole run (a gang: each member) gets, and each member's share.

        (None, shares) where the devices of a host are not known: the worker's allocator then chooses.
        """
        addresses = [self.addresses[h] for h, _ in holds]
        free = [[d for d in self.devices.get(a, ()) if d.idle and spec.whole_fits(d)] for a in addresses]
        if len(holds) == 1:
            shares = [gpus]
        elif spec.width:
            shares = [gpus // spec.width] * spec.width
        else:
            caps = [len(f) if a in self.devices else g for f, a, (_, g) in zip(free, addresses, holds)]
            shares = split(gpus, caps) or [g for _, g in holds]
        if any(a not in self.devices for a in addresses) or any(len(f) < n for f, n in zip(free, shares)):
            return None, shares
        out = []
        for a, f, n in zip(addresses, free, shares):
            chosen = sorted(f, key=lambda d: (d.memory, d.key))[:n]  # keep big devices for big requests
            for d in chosen:
                d.whole = jid
            out.append(sorted((d.key for d in chosen), key=_device_order))
        self.assigned[jid] = [(a, keys) for a, keys in zip(addresses, out)]
        return out, shares

    def _unassign(self, jid: int) -> None:
        for address, keys in self.assigned.pop(jid, []):
            for d in self.devices.get(address, ()):
                if d.key in keys and d.whole == jid:
                    d.whole = None

    def _start_fraction(self, jid: int, client: str, address: str, d: Device, spec: Spec, job: Job) -> None:
        units, gb = spec.reserve(d)
        self.fraction_runs[jid] = (job, time.time(), spec.share)
        d.share += units
        d.mem += gb
        d.fractions.add(jid)
        self.fractions[jid] = (address, d, units, gb, client)
        self._answer(jid, {"workers": [address], "devices": [[d.key]], "shares": [spec.share]})

    def _end_fraction(self, jid: int) -> None:
        address, d, units, gb, _ = self.fractions.pop(jid)
        ran = self.fraction_runs.pop(jid, None)
        if ran is not None:  # every fraction ends once in the policy's books (the one that opened the device too)
            self.policy.finish([ran[0]], time.time())
        d.share -= units
        d.mem -= gb
        d.fractions.discard(jid)
        if not d.fractions and d.anchor is not None:  # the last fraction left: the device counts as free again
            if d.anchor in self.state.running:
                self.state.release(d.anchor)
            d.anchor = None
