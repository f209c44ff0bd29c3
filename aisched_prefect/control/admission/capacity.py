"""Runs admitted for capacity that can be started: a Slurm job of a worker group the scaler has at 0 jobs.

Feasibility reads the workers that joined and, beside them, the groups `dask-gpu-slurm` publishes on the scheduler
(dask_gpu.slurm.capacity: the operator's configuration, which only a client-certificate holder can publish, never a
flow). A run the joined workers cannot hold but a group can is admitted as waiting for capacity: recorded, its
budget held as any waiting run's, entered in the cluster's queue limited to workers that join for it (the queue
widens it to a joining worker whose tenant and devices hold it), and the scaler counts it in its backlog and submits.

While it waits, the control plane follows the group's jobs as the scaler publishes them and records each change
(`capacity-wait`: "a Slurm job of group a100-1 was submitted: job 41, pending: Resources"). If no worker of the
group joined within the scaler's `start_seconds`, the run is taken out of the queue and fails with Slurm's own pending
reason; its holds are voided: nothing ran, nothing is charged.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aisched_prefect.errors import AdmissionDenied
from aisched_prefect.request import AIRequest
from dask_gpu import WorkerInventory
from dask_gpu.slurm.capacity import CAPACITY_PREFIX, Capacity, groups_of, read_capacity

logger = logging.getLogger("aisched_prefect.control")

NO_CAPACITY = "no capacity: "  # a stop reason: the run's group started no worker within its bound
POLL_SECONDS = 1.0
DEFAULT_BOUND = 600.0  # a run admitted just as the scaler's publication went stale: the scaler's own default


@dataclass
class _Waiting:
    """A run waiting for a group's first worker, as the follower sees it."""

    state: Any
    groups: list[str]
    deadline: float  # monotonic
    bound: float
    said: str = ""
    lines: list[str] = field(default_factory=list)  # every change of what it waited for, for its flow's log


def joined_only(inventories: dict[str, WorkerInventory]) -> dict[str, WorkerInventory]:
    return {k: v for k, v in inventories.items() if not k.startswith(CAPACITY_PREFIX)}


def waits_for_capacity(workers: list[str]) -> list[str]:
    """The groups a run was admitted for, where the joined workers alone could not hold it (else []): its eligible
    workers name a stand-in for a job a group can start (a gang may also name joined workers)."""
    return groups_of(workers)


def feasible(check: Any, request: AIRequest, inventories: dict[str, WorkerInventory], tenant: str | None,
             refused: AdmissionDenied) -> tuple[list[str], list[str]]:
    """The joined workers refused the run (`refused`): the scaler's groups may hold it. `check` is stage 1's
    feasibility. Raises `refused`, naming the groups too, where no group can hold it either."""
    standins = {k: v for k, v in inventories.items() if k.startswith(CAPACITY_PREFIX)}
    if not standins:
        raise refused
    try:
        return check(request, {**joined_only(inventories), **standins}, tenant)
    except AdmissionDenied:
        groups = sorted({k[len(CAPACITY_PREFIX):].split("#", 1)[0] + f" ({v.devices[0].gpu_type} x{len(v.devices)}, "
                         f"{v.tenant or 'every tenant'})" for k, v in standins.items()})
        raise AdmissionDenied(refused.stage, f"{refused.reason}; and no worker group of dask-gpu-slurm can start one "
                              f"that holds it (its groups: {', '.join(groups)})",
                              f"{refused.fix}; or the operator adds such a group to the scaler's configuration"
                              ) from None


class CapacityWaits:
    """The dispatcher's part that follows runs waiting for a group's first worker (a mixin of Dispatcher)."""

    def capacity(self) -> Capacity | None:
        return read_capacity(self.client)  # type: ignore[attr-defined]

    def with_capacity(self, inventories: dict[str, WorkerInventory]) -> dict[str, WorkerInventory]:
        """The joined workers' inventories and one stand-in per job the scaler's groups may start (with the cluster's
        queue on: only the queue gives a run to a worker that joins after its admission)."""
        if not getattr(self, "queue", True):
            return inventories
        cap = self.capacity()
        return {**inventories, **(cap.inventories() if cap is not None else {})}

    def follow_capacity(self, state: Any) -> str:
        """Start following a run admitted for capacity; the line its flow's log gets now. One thread follows every
        such run (a map of 10,000 shards waiting for a group reads the publication once a second, not 10,000 times)."""
        groups = waits_for_capacity(state.admission.workers)
        cap = self.capacity()
        bound = cap.bound(groups) if cap is not None else DEFAULT_BOUND
        note = (f"waits for capacity: a worker of Slurm group {' or '.join(groups)} (dask-gpu-slurm submits its job; "
                f"at most {bound:g} s, then it fails with Slurm's reason)")
        books = self.__dict__.setdefault("_capacity", {"runs": {}, "notes": {}, "said": {}, "lock": threading.Lock(),
                                                       "thread": None})
        with books["lock"]:
            books["notes"][state.key] = note
            books["runs"][state.key] = books["said"][state.key] = _Waiting(state, groups, time.monotonic() + bound,
                                                                           bound)
            if books["thread"] is None or not books["thread"].is_alive():
                books["thread"] = threading.Thread(target=self._follow_all, args=(books,), name="aisched-capacity",
                                                   daemon=True)
                books["thread"].start()
        return note

    def capacity_note(self, key: str) -> str:
        """What a run launched under `key` waits for ('' for a run that waits for no capacity), once."""
        books = self.__dict__.get("_capacity")
        if books is None:
            return ""
        with books["lock"]:
            return books["notes"].pop(key, "")

    def capacity_said(self, key: str) -> list[str]:
        """Each change of what the run under `key` waited for (Slurm's words), once: its flow's log gets them."""
        books = self.__dict__.get("_capacity")
        if books is None:
            return []
        with books["lock"]:
            w = books["said"].pop(key, None)
        return list(w.lines) if w is not None else []

    def _follow_all(self, books: dict[str, Any]) -> None:
        while True:
            with books["lock"]:
                waiting = [w for w in books["runs"].values()]
                for w in waiting:
                    if w.state.placed or w.state.stop_reason is not None:
                        books["runs"].pop(w.state.key, None)
                        books["notes"].pop(w.state.key, None)
                if not books["runs"]:
                    books["thread"] = None
                    return
            cap = self.capacity()
            now = time.monotonic()
            for w in waiting:
                if w.state.placed or w.state.stop_reason is not None:
                    continue
                line = cap.waiting_for(w.groups) if cap is not None else "dask-gpu-slurm publishes its groups no more"
                if line != w.said:
                    w.said = line
                    w.lines.append(line)
                    self._say(w, line)
                if now >= w.deadline:
                    why = f"{NO_CAPACITY}no worker of group {' or '.join(w.groups)} joined within {w.bound:g} s: {line}"
                    self.stop([w.state.key], why)  # type: ignore[attr-defined]
            time.sleep(POLL_SECONDS)

    def _say(self, w: _Waiting, line: str) -> None:
        """Each change of what a run waits for: the plane's log and a `capacity-wait` record (its evidence)."""
        adm = w.state.admission
        logger.warning("AI task %s %s", adm.task_name, line)
        try:
            payload = {"task": adm.task_name, "admission": adm.id, "groups": w.groups, "waiting_for": line}
            self.ledger.record("capacity-wait", payload, **adm.ids)  # type: ignore[attr-defined]
        except Exception:  # evidence of a wait, never a condition for it
            logger.warning("could not record the capacity wait", exc_info=True)

    def capacity_denied(self, state: Any) -> tuple[str, str] | None:
        """(reason, fix) for a run that left the queue because its group started nothing in time, else None."""
        reason = state.stop_reason or ""
        if state.placement is not None or not reason.startswith(NO_CAPACITY):
            return None
        return (reason[len(NO_CAPACITY):], "the operator checks the group's partition and Slurm's reason "
                "(squeue, sinfo), or raises policy.start_seconds in the scaler's configuration")


__all__ = ["CapacityWaits", "NO_CAPACITY", "feasible", "joined_only", "waits_for_capacity"]
