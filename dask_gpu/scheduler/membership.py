"""The cluster's queue as workers and clients come and go: a worker's devices learned or lost, a client's runs
dropped when it goes away."""

from __future__ import annotations

import time
from typing import Any


class Membership:
    """The queue plugin's scheduler hooks for workers and clients (a mixin of GPUQueuePlugin)."""

    def add_worker(self, scheduler: Any, worker: str) -> None:
        gpus = int(scheduler.workers[worker].resources.get("GPU", 0)) if worker in scheduler.workers else 0
        if worker in self.addresses:
            h = self.addresses.index(worker)
            self.state.size[h] = gpus
            self.state.free[h] = gpus - sum(g for r, _ in self.running.values() for x, g in r.holds if x == h)
        else:
            self.addresses.append(worker)
            self.state.add_host(gpus)
        self._learn_soon(worker)
        self._dispatch()

    def _address(self, worker: str) -> str | None:
        """A worker's address from its address or its name (inventories are keyed by name)."""
        if worker in self.scheduler.workers:
            return worker
        return next((a for a, ws in self.scheduler.workers.items() if ws.name == worker), None)

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        if worker in self.addresses:
            self._warm_worker_gone(worker)
            h = self.addresses.index(worker)
            self.state.free[h] = self.state.size[h] = 0
            for jid, (run, _) in list(self.running.items()):
                if h in run.hosts:  # Dask reschedules or fails it; its place here is gone either way
                    self._drop_running(jid, free=False)
                    for x, g in run.holds:  # a gang's other workers are free again
                        if x != h:
                            self.state.free[x] += g
            for jid in [j for j, f in self.fractions.items() if f[0] == worker]:
                d = self.fractions.pop(jid)[1]
                ran = self.fraction_runs.pop(jid, None)
                if ran is not None:
                    self.policy.finish([ran[0]], time.time())
                if d.anchor is not None and d.anchor in self.state.running:
                    self.state.running.remove(d.anchor)
                d.anchor = None
            self.devices.pop(worker, None)
            self._learning.pop(worker, None)
            self._dispatch()

    def remove_client(self, scheduler: Any, client: str) -> None:
        """A client went away (its flow process died): forget what it queued and free what it ran."""
        mine = [jid for jid, (c, _) in self.waiters.items() if c == client]
        if mine:
            self.policy.withdraw([self.waiters[j][1] for j in mine])
            for jid in mine:
                del self.waiters[jid]
                self._answer(jid, None)
        for jid, (_, c) in list(self.running.items()):
            if c == client:
                self._drop_running(jid)
        for jid in [j for j, f in self.fractions.items() if f[4] == client]:
            self._end_fraction(jid)
        self._expire_requeue(time.time(), client)
        self.preempted = {j: p for j, p in self.preempted.items() if p[1] != client}
        self.keys = {k: j for k, j in self.keys.items()
                     if j in self.waiters or j in self.running or j in self.preempted or j in self.fractions}
        self.tasks = {j: k for j, k in self.tasks.items() if j in self.waiters or j in self.running}
        self.specs = {j: v for j, v in self.specs.items() if j in self.waiters or j in self.running}
        self.warm_keys = {j: k for j, k in self.warm_keys.items()
                          if j in self.waiters or j in self.running or j in self.fractions}
        self._dispatch()
