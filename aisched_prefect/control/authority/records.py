"""The evidence records authority is folded from: one typed payload per kind, shared by writer and reader.

The control plane writes each with `record(ledger, payload)`; `authority/state.py`
reads them back with `parse(kind, payload)`. A record kind and its payload
never drift apart, and a record some other writer put in the log that does
not validate is not authority.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from aisched_prefect.control.authority.identity import Credential
from aisched_prefect.ledger import Ledger
from blocks import Grant


class _Payload(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")
    kind: Any = None  # each subclass fixes its record kind


class CredentialIssued(_Payload):
    kind: Literal["credential-issued"] = "credential-issued"
    credential: Credential
    by: str


class CredentialRevoked(_Payload):
    kind: Literal["credential-revoked"] = "credential-revoked"
    id: str
    by: str


class ConfigApplied(_Payload):
    kind: Literal["config-applied"] = "config-applied"
    config_kind: str
    name: str
    version: int
    digest: str
    body: dict[str, Any]
    by: str


class Delegation(_Payload):
    kind: Literal["delegation"] = "delegation"
    grant: Grant
    by: str
    authority: str | None = None  # the applied authority whose roots it descends from (None: written before they named it)


class Revocation(_Payload):
    kind: Literal["revocation"] = "revocation"
    grant: str
    authority: str | None = None  # None: a revocation from before they named their authority (applies everywhere)
    by: str | None = None
    reason: str | None = None


class ConfigDrift(_Payload):
    kind: Literal["config-drift"] = "config-drift"
    config_kind: str
    name: str
    applied_version: int
    applied_digest: str
    block_digest: str
    rule: str = "an edit takes effect only once an operator applies it (aisched apply)"


class AttemptLost(_Payload):
    kind: Literal["attempt-lost"] = "attempt-lost"
    task: str
    admission: str
    replica: str
    taken_over_by: str


class ResultLostRecord(_Payload):
    """A completed run's large result its flow could not fetch from the worker that kept it. Its settlement stays as
    the run ran (charged): this record, about the same admission, marks it."""

    kind: Literal["result-lost"] = "result-lost"
    call: str  # the call's key at the control plane
    task: str
    admission: str
    worker: str  # the listener the result was kept on (from the call book, not from the flow)
    reason: str  # what the flow's last fetch attempt met (its words, bounded)
    settlement: int | None = None  # the settlement record it marks
    reported_by: str


AUTHORITY_KINDS: dict[str, type[_Payload]] = {
    "credential-issued": CredentialIssued, "credential-revoked": CredentialRevoked, "config-applied": ConfigApplied,
    "delegation": Delegation, "revocation": Revocation,
}


def _wire(payload: _Payload) -> dict[str, Any]:
    """What goes into the log: the payload's fields (`config_kind` under its historical name `kind`)."""
    data = payload.model_dump(mode="json", exclude={"kind"})
    if "config_kind" in data:
        data["kind"] = data.pop("config_kind")
    return data


def parse(kind: str, payload: dict[str, Any]) -> _Payload:
    data = dict(payload)
    if kind in ("config-applied", "config-drift") and "kind" in data:
        data["config_kind"] = data.pop("kind")
    return AUTHORITY_KINDS.get(kind, {"config-drift": ConfigDrift, "attempt-lost": AttemptLost,
                                      "result-lost": ResultLostRecord}.get(kind, _Payload)).model_validate(data)


def record(ledger: Ledger, payload: _Payload, *, principal: str | None = None, flow_run_id: str | None = None,
           task_run_id: str | None = None) -> Any:
    return ledger.record(payload.kind, _wire(payload), principal=principal, flow_run_id=flow_run_id,
                         task_run_id=task_run_id)
