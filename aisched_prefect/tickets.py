"""Signed admission tickets: no ticket, no run.

Each runner session holds an Ed25519 key pair it made when it opened. It
registers the public half on the cluster as a worker plugin (the scheduler
hands it to workers that join later, and to workers restarted by their
nanny), signs one ticket per admitted run, and unregisters the key when it
closes. The worker refuses a run whose ticket is missing, signed by a key it
does not trust, altered, issued for another request, expired, or already used.

Threat model: this stops a run that skipped admission, a request changed after
admission, and a ticket used twice. It does not stop a party that may already
run arbitrary code on the workers (any Dask client can): Dask's own TLS and
authentication are the boundary for that.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from distributed.diagnostics.plugin import WorkerPlugin
from pydantic import BaseModel, ConfigDict

from aisched_prefect.errors import TicketRejected

if TYPE_CHECKING:
    from distributed import Client, Worker

GATE_PREFIX = "aisched-tickets-"


class AdmissionTicket(BaseModel):
    """Proof that a run passed admission, bound to its task run, request and grant chain."""

    model_config = ConfigDict(frozen=True)

    key_id: str
    admission_seq: int
    task_run_id: str
    request_digest: str
    chain: tuple[str, ...]
    expires_at: float
    signature: str = ""

    def body(self) -> bytes:
        return json.dumps(self.model_dump(exclude={"signature"}), sort_keys=True, separators=(",", ":")).encode()


class TicketGate(WorkerPlugin):
    """On a worker: one trusted session key, and the tickets already used under it."""

    def __init__(self, key_id: str, public_key: bytes) -> None:
        self.key_id = key_id
        self.public_key = public_key
        self._used: set[int] = set()
        self._lock = threading.Lock()

    def setup(self, worker: Worker) -> None:
        self._verifier = Ed25519PublicKey.from_public_bytes(self.public_key)

    def admit(self, ticket: AdmissionTicket) -> None:
        try:
            self._verifier.verify(bytes.fromhex(ticket.signature), ticket.body())
        except (InvalidSignature, ValueError):
            raise TicketRejected(f"ticket for task run {ticket.task_run_id} has a bad signature: forged or altered") from None
        with self._lock:
            if ticket.admission_seq in self._used:
                raise TicketRejected(f"ticket for task run {ticket.task_run_id} was already used: replay refused")
            self._used.add(ticket.admission_seq)

    def __getstate__(self) -> dict[str, Any]:  # sent to workers: the key only, never the used set or lock
        return {"key_id": self.key_id, "public_key": self.public_key}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["key_id"], state["public_key"])  # type: ignore[misc]


class TicketSigner:
    """A session's signing key, trusted by the cluster's workers while the session is open."""

    def __init__(self) -> None:
        self.key_id = uuid.uuid4().hex[:16]
        self._key = Ed25519PrivateKey.generate()
        self.public_key = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def register(self, client: Client) -> None:
        client.register_plugin(TicketGate(self.key_id, self.public_key), name=GATE_PREFIX + self.key_id)

    def unregister(self, client: Client) -> None:
        try:
            client.unregister_worker_plugin(GATE_PREFIX + self.key_id)
        except Exception:  # workers gone or scheduler closing: nothing left to trust the key
            pass

    def issue(self, **fields: Any) -> AdmissionTicket:
        unsigned = AdmissionTicket(key_id=self.key_id, **fields)
        return unsigned.model_copy(update={"signature": self._key.sign(unsigned.body()).hex()})


def check_ticket(ticket: AdmissionTicket | None, request_digest: str, worker: Worker) -> None:
    """Run on the worker before the task: refuse a missing, untrusted, forged, altered, expired or replayed ticket."""
    if ticket is None:
        raise TicketRejected("no admission ticket: AI tasks run only after admission by AISchedTaskRunner")
    gate = worker.plugins.get(GATE_PREFIX + ticket.key_id)
    if not isinstance(gate, TicketGate):
        raise TicketRejected(f"ticket for task run {ticket.task_run_id} is signed by key {ticket.key_id!r}, "
                             "which this worker does not trust")
    if ticket.request_digest != request_digest:
        raise TicketRejected(f"ticket for task run {ticket.task_run_id} was issued for another request")
    if time.time() > ticket.expires_at:
        raise TicketRejected(f"ticket for task run {ticket.task_run_id} expired; the run must be admitted again")
    gate.admit(ticket)
