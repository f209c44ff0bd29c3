"""What the dispatcher keeps of one admitted run while it runs, and the small records around it."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from aisched_prefect.control.admission.record import Admission
from aisched_prefect.ledger import Hold
from aisched_prefect.wire import Reply
from dask_gpu.worker.records import Body
from dask_gpu.tickets import Ticket

logger = logging.getLogger("aisched_prefect.control")


@dataclass(frozen=True)
class Placement:
    """Where a run goes: its workers (a gang: member 0 first), the devices chosen on each (None: the worker
    chooses) and what each member holds."""

    workers: list[str]
    devices: list[list[str]] | None = None
    shares: list[float] = field(default_factory=list)
    body: str | None = None  # an idle warm body of the run's key the queue chose (its worker checks the key)
    plan: dict[str, float] | None = None  # the estimate the queue planned it on: declared, factor, planned


class Lost(Exception):
    """The worker (or one member's worker) running a run died under it (inside the dispatcher; the flow gets
    dask_gpu.WorkerDied)."""

    def __init__(self, lost: dict[str, Any]) -> None:
        self.lost = lost
        super().__init__(f"worker {lost.get('name') or lost.get('worker')} died")


@dataclass
class Running:
    """One admitted run between its hand-over to Dask and its settlement, as the watcher sees it."""

    admission: Admission
    key: str
    holds: list[Hold]
    covered_seconds: float
    submitted: float  # monotonic
    extra_cost: float = 0.0
    started_at: float | None = None
    top_up_refused: str | None = None
    stop_reason: str | None = None
    queue_id: str | None = None
    preempted_for: str | None = None
    placed: bool = False
    asked: set[float] = field(default_factory=set)
    model_limit: dict[str, Any] | None = None  # which model limit it waited for, and how long
    settled: bool = False  # set (under `holds_lock`) as its holds are read for settlement: no top-up after that
    holds_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    members: list[str] = field(default_factory=list)  # a gang's Dask keys, member 0 first (empty: `key` alone)
    placement: Placement | None = None  # where the queue (or the gang placement) put it
    ticket: Ticket | None = None
    dask_at: float | None = None  # monotonic time it was handed to Dask (or straight to its worker)
    handed_over: bool = False  # straight to the worker the queue placed it on: no Dask task to look for
    lost: dict[str, Any] | None = None  # the worker that died under it: worker, name, devices, keys
    wake: threading.Event = field(default_factory=threading.Event, repr=False)
    call_key: str = ""  # the control plane's key of the call it serves

    @property
    def dask_keys(self) -> list[str]:
        """The Dask keys it runs under: its own, or one per gang member."""
        return self.members or [self.key]

    def add_holds(self, reserve: Any, seconds: float = 0.0, cost: float = 0.0) -> bool:
        """Take a top-up (`reserve()` returns its holds) covering `seconds` more, unless the run is being settled;
        False if it was. Holds and cover change together, under the lock its settlement reads them under."""
        with self.holds_lock:
            if self.settled:
                return False
            self.holds.extend(reserve())
            self.covered_seconds += seconds
            self.extra_cost += cost
            return True


@dataclass(frozen=True)
class BodyParts:
    """An admitted call's body while it waits: its function's pickle (shared by the runs of one `.map()`) and its
    arguments', joined into the `Body` Dask carries only when the run is handed over."""

    fn: bytes
    args: bytes
    modules: tuple[str, ...] = ()

    def body(self) -> Body:
        return Body(payload=self.fn + self.args, modules=list(self.modules))


class ModelSlotUnavailable(Exception):
    """The cluster's scheduler could not give a model call its rate or concurrency slot (no model-limits plugin)."""


class Preempted(Exception):
    """The cluster's queue stopped a run to give borrowed GPUs back; it was charged and will queue again."""



def held_by_account(holds: list[Hold]) -> dict[str, float]:
    """What the holds cover, per account: the charge of a run whose outcome is unknown."""
    out: dict[str, float] = {}
    for h in holds:
        out[h.budget] = out.get(h.budget, 0.0) + h.reserved
    return out


def base_payload(adm: Admission) -> dict[str, Any]:
    return {"task": adm.task_name, "flow": adm.flow_name, "tenant": adm.tenant,
            "request": adm.request.model_dump(mode="json"), "chain": adm.chain, "grant": adm.chain[-1] if adm.chain else None,
            "admission": adm.id, **({"approval_digest": adm.approval_digest} if adm.approval_digest else {})}


def _crashed(adm: Admission, exc: BaseException) -> Reply:
    """A run whose dispatch raised: its reply names the cause (never a bare error without one)."""
    logger.error("AI task %s (admission %s) ended by %s: %s", adm.task_name, adm.id, type(exc).__name__, exc)
    return Reply(status="failed", admission=adm.id, error_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
                 error_message=f"the control plane could not run it: {type(exc).__name__}: {exc}")


def denied(stage: str, reason: str, fix: str) -> Reply:
    return Reply(status="denied", stage=stage, reason=reason, fix=fix)

