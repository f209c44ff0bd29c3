"""The admission record: what an admitted run (or one waiting for a person) carries to dispatch, settlement and
every replica, and the memory of which code versions ran.

How a call becomes one is pipeline.py: its phases, in order, over one snapshot (phases.py).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

from aisched_prefect.ledger import Hold, Ledger
from aisched_prefect.request import AIRequest
from aisched_prefect.wire import MapShard
from blocks import RunFacts

logger = logging.getLogger("aisched_prefect.control")


class Admission(BaseModel):
    """An admitted run (or one waiting for a person): what dispatch and settlement need, from any replica."""

    model_config = ConfigDict(frozen=True)

    id: str
    credential: str
    principal: str
    tenant: str
    flow_run_id: str
    task_run_id: str
    task_name: str
    flow_name: str | None
    run_key: str
    request: AIRequest
    workers: list[str]
    holds: list[Hold]
    reserved: float
    priced_type: str | None
    chain: list[str]
    expires_at: float | None
    facts: RunFacts
    shares: dict[str, float] = {}
    priority: int = 0
    payload_digest: str
    code_digest: str  # what the flow says its function's code hashes to (the body checks it); never trusted here
    function_digest: str = ""  # sha256 of the function's pickled bytes as received, computed by the control plane
    versions: dict[str, str] = {}
    approval: str | None = None
    approval_digest: str | None = None
    keep_warm_seconds: float | None = None  # its body's keep-warm time, cut to fit max_cost_per_run (None: as asked)
    idle_cost: float = 0.0  # what that idle time may cost: part of its price (control.idle_price)
    array: MapShard | None = None  # the `.map()` it is a shard of: a refusal after its admission names the shard
    hold_at_start: bool = False  # a later shard of a map: its budget is held when the queue starts it, not before

    @property
    def authority(self) -> str | None:
        """The name of the applied authority it was admitted under."""
        ref = self.versions.get("authority")
        return ref.split(":", 1)[1].rsplit("@", 1)[0] if ref else None

    @property
    def ids(self) -> dict[str, Any]:
        return {"flow_run_id": self.flow_run_id, "task_run_id": self.task_run_id, "principal": self.principal}


def version_scope(authority: str | None, tenant: str, flow: str) -> str:
    """The name code versions are remembered under: the flow's name within one authority and tenant (another
    tenant's approval of the same bytes is not this tenant's), at most 200 characters."""
    scope = hashlib.sha256(f"{authority}\n{tenant}\n{flow}".encode()).hexdigest()[:16]
    return f"{flow[:150]}#{scope}"


def mark_version_seen(ledger: Ledger, admission: Admission) -> list[tuple[str, str]]:
    """Remember that this admission's code ran (admitted without asking, or its approval used): the
    `new_flow_version` rule does not ask again for the same bytes of the same flow. Never for a call without a
    flow name or a digest. A failure is logged, not raised (its holds are taken; unmarked, it asks again)."""
    if not admission.facts.first_of_version or not admission.flow_name or not admission.function_digest:
        return []
    key = (version_scope(admission.authority, admission.tenant, admission.flow_name), admission.function_digest)
    try:
        ledger.mark_flow_version(*key)
    except Exception:
        logger.exception("could not mark flow %s version %s as seen", admission.flow_name, admission.function_digest)
        return []
    return [key]


class Readmitter(Protocol):
    """What dispatch needs of admission: a preempted run admitted again, and a map's shard held as it starts
    (pipeline.Pipeline.readmit and .hold_at_start)."""

    def readmit(self, admission: Admission, reason: str) -> Admission: ...

    def hold_at_start(self, admission: Admission) -> Admission: ...
