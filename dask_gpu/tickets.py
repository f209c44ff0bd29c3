"""Signed tickets: a GPU worker runs a body only with a ticket signed by a key it trusted when it started.

The trusted keys come from the worker's own start-up (`DASK_GPU_TRUSTED_KEYS`,
or `dask-gpu-worker --trust-key`), never from a client: any Dask client may
register plugins, so a key a client hands over proves nothing. A ticket binds
the exact bytes that will run (body and arguments), the code's digest, the GPU
request and the run it was issued for; it is redeemed once for the whole
cluster (at the scheduler's ticket registry), so a re-run Dask does on its own
after a worker dies, or a replay on another worker, is refused.

>>> signer = TicketSigner.generate()
>>> t = signer.issue(run="r1", payload_digest="ab", code_digest="cd", request=GPURequest(gpus=1))
>>> verify_signature(t, {signer.key_id: signer.public_key}) is None
True
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import json
import os
import time
import uuid
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from distributed.diagnostics.plugin import SchedulerPlugin
from pydantic import BaseModel, ConfigDict, Field

from dask_gpu.errors import TicketRejected  # noqa: F401 (where it was: it lives in errors now)
from dask_gpu.request import GPURequest

TRUSTED_KEYS_ENV = "DASK_GPU_TRUSTED_KEYS"
REGISTRY_NAME = "dask-gpu-tickets"
REDEEM_OP = "gpu_ticket_redeem"
WHERE_OP = "gpu_ticket_where"
MEET_OP = "gpu_gang_meet"
STATES_OP = "gpu_task_states"
PLACED_TOPIC = "aisched-placed"  # a worker's event: a run (ticket, member) holds these devices
DIED_TOPIC = "aisched-worker-died"  # the registry's event: a worker left (with the runs that were on it, if any)
LEFT_OP = "gpu_workers_left"  # when each worker that left did (a control plane that was away asks)
LEFT_KEPT = 4096
KEY_PREFIX = "aisched-"  # the Dask keys of admitted runs


class Ticket(BaseModel):
    """Proof that a run was admitted, bound to what will run and on what."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    key_id: str
    run: str
    payload_digest: str
    code_digest: str
    request: GPURequest
    issued_at: float
    expires_at: float
    lease_seconds: float = 300.0
    hosts: int = 1
    shares: tuple[int, ...] = ()  # a gang: the GPUs each member holds on its worker (member i: shares[i])
    tenant: str = ""  # whose body this is: each tenant's bodies fork from a zygote of its own (old tickets: "")
    workers: tuple[str, ...] = ()  # where it may run (a gang: member i on workers[i]); () = any worker
    warm: str = ""  # its body's key (tenant, principal, code, request): a warm body serves only runs of its key
    keep_warm: float = Field(default=0.0, ge=0)  # seconds its body may wait for the next run of its key (0: it ends)
    signature: str = ""

    def member_request(self, member: int) -> GPURequest:
        """What member `member` holds on its worker: the whole request, or its share of a gang's."""
        if self.hosts <= 1:
            return self.request
        if not 0 <= member < len(self.shares):
            raise TicketRejected(f"ticket for run {self.run} has no member {member}")
        return self.request.member(self.shares[member])

    def check_worker(self, address: str, member: int, name: str = "") -> None:
        """A ticket runs only where the control plane placed it (a worker by address, or by name where Dask
        chooses among named workers): a scheduler that hands it elsewhere is refused."""
        if not self.workers:
            return
        allowed = [self.workers[member]] if self.hosts > 1 and member < len(self.workers) else list(self.workers)
        if address not in allowed and (not name or name not in allowed):
            raise TicketRejected(f"ticket {self.id[:8]} of run {self.run} was issued for {', '.join(allowed)}, not "
                                 f"{address}: refused (the scheduler placed it somewhere the control plane did not)")

    def body(self) -> bytes:
        return json.dumps(self.model_dump(mode="json", exclude={"signature"}), sort_keys=True,
                          separators=(",", ":")).encode()


def key_id_of(public_key: bytes) -> str:
    """Short, stable name of a public key.

    >>> key_id_of(bytes(32))
    '66687aadf862bd77'
    """
    return hashlib.sha256(public_key).hexdigest()[:16]


class TicketSigner:
    """The private half: only the control plane holds one."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.public_key = private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.key_id = key_id_of(self.public_key)

    @classmethod
    def generate(cls) -> TicketSigner:
        return cls(Ed25519PrivateKey.generate())

    def sign(self, data: bytes) -> str:
        return self._key.sign(data).hex()

    def issue(self, *, run: str, payload_digest: str, code_digest: str, request: GPURequest,
              ttl_seconds: float = 600.0, lease_seconds: float = 300.0, hosts: int = 1,
              shares: tuple[int, ...] | list[int] = (), tenant: str = "",
              workers: tuple[str, ...] | list[str] = (), warm: str = "", keep_warm: float = 0.0) -> Ticket:
        now = time.time()
        unsigned = Ticket(key_id=self.key_id, run=run, payload_digest=payload_digest, code_digest=code_digest,
                          request=request, issued_at=now, expires_at=now + ttl_seconds, lease_seconds=lease_seconds,
                          hosts=hosts, shares=tuple(shares), tenant=tenant, workers=tuple(workers), warm=warm,
                          keep_warm=keep_warm if warm and hosts <= 1 else 0.0)
        return unsigned.model_copy(update={"signature": self.sign(unsigned.body())})


def parse_trusted_keys(spec: str | None) -> dict[str, bytes]:
    """`hex[,hex...]` -> key id -> public key; a malformed key is an error naming the setting.

    >>> list(parse_trusted_keys("00" * 32))
    ['66687aadf862bd77']
    """
    keys: dict[str, bytes] = {}
    for part in (spec or "").replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        try:
            raw = bytes.fromhex(part)
            Ed25519PublicKey.from_public_bytes(raw)
        except ValueError:
            raise TicketRejected(f"{TRUSTED_KEYS_ENV} holds {part[:16]!r}..., not a 64-hex-digit Ed25519 public key. "
                                 "Fix: pass the control plane's key as printed by `aisched serve --print-key`") from None
        keys[key_id_of(raw)] = raw
    return keys


def trusted_keys_from_env() -> dict[str, bytes]:
    return parse_trusted_keys(os.environ.get(TRUSTED_KEYS_ENV))


def verify_signature(ticket: Ticket | None, trusted: dict[str, bytes]) -> None:
    """Raise TicketRejected unless `ticket` is signed by a trusted key and still valid."""
    if ticket is None:
        raise TicketRejected("no ticket: this worker runs GPU bodies only after admission by the control plane")
    key = trusted.get(ticket.key_id)
    if key is None:
        raise TicketRejected(f"ticket for run {ticket.run} is signed by key {ticket.key_id!r}, which this worker "
                             "was not started to trust")
    try:
        Ed25519PublicKey.from_public_bytes(key).verify(bytes.fromhex(ticket.signature), ticket.body())
    except (InvalidSignature, ValueError):
        raise TicketRejected(f"ticket for run {ticket.run} has a bad signature: forged or altered") from None
    if time.time() > ticket.expires_at:
        raise TicketRejected(f"ticket for run {ticket.run} expired; the run must be admitted again")


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class TicketRegistry(SchedulerPlugin):
    """On the scheduler: every ticket redeemed, until it expires. One redemption per ticket, cluster-wide.

    Gang runs (several hosts) redeem once per member: `member` tells them apart,
    and meet (`gpu_gang_meet`) once each holds its devices, to learn where
    member 0 listens. The registry also remembers where each redeemed ticket
    runs (worker, devices, as the worker reports them in an `aisched-placed`
    event) and which redemptions it refused, so that when a worker dies it
    publishes one `aisched-worker-died` event naming the worker and the runs and
    devices lost with it, which the control plane subscribes to, and answers
    `gpu_ticket_where` (each member's placement and every refused attempt).
    """

    name = REGISTRY_NAME
    idempotent = True  # a second control plane (a replica) must not replace it and forget what was redeemed

    def __init__(self) -> None:
        # The scheduler's event loop is the only caller of everything below: no lock.
        self._used: dict[tuple[str, int], float] = {}
        self._expiry: list[tuple[float, str, int]] = []  # (expires_at, ticket, member) of each redemption: a heap
        self._live: dict[str, int] = {}  # ticket -> its members redeemed and not expired
        self._where: dict[tuple[str, int], dict[str, Any]] = {}  # (ticket, member) -> key, worker, name, devices
        self._refused: dict[str, list[dict[str, Any]]] = {}  # ticket -> attempts refused after the first
        self._gangs: dict[str, dict[str, Any]] = {}  # ticket -> members met so far, and the event all wait on
        self._names: dict[str, str] = {}  # worker address -> name, kept after it leaves
        self._left: dict[str, float] = {}  # worker address -> when it left (the newest LEFT_KEPT)
        self.scheduler: Any = None

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        scheduler.handlers[REDEEM_OP] = self.redeem
        scheduler.handlers[WHERE_OP] = self.where
        scheduler.handlers[MEET_OP] = self.meet
        scheduler.handlers[STATES_OP] = self.states
        scheduler.handlers[LEFT_OP] = self.workers_left
        for address, ws in scheduler.workers.items():
            self._names[address] = str(ws.name)

    def add_worker(self, scheduler: Any, worker: str) -> None:
        ws = scheduler.workers.get(worker)
        if ws is not None:
            self._names[worker] = str(ws.name)

    def _prune(self, now: float) -> None:
        """Forget redemptions whose ticket expired (a worker refuses an expired ticket itself): the earliest first,
        off a heap, so a redemption costs the ones that expired since the last, not one look at each of the
        thousands a map's shards still hold."""
        while self._expiry and self._expiry[0][0] <= now:
            _, id, member = heapq.heappop(self._expiry)
            self._used.pop((id, member), None)
            self._where.pop((id, member), None)
            left = self._live.get(id, 1) - 1
            if left > 0:
                self._live[id] = left
                continue
            self._live.pop(id, None)
            self._refused.pop(id, None)
            self._gangs.pop(id, None)

    def redeem(self, id: str, expires_at: float, member: int = 0, hosts: int = 1, worker: str = "",
               key: str = "") -> bool:
        now = time.time()
        self._prune(now)
        if (id, member) in self._used or not 0 <= member < max(hosts, 1):
            self._refused.setdefault(id, []).append({"member": member, "worker": worker, "key": key,
                                                     "name": self._names.get(worker, worker), "at": now})
            if id not in self._live:  # none of its members holds it: forgotten when the ticket expires
                heapq.heappush(self._expiry, (max(expires_at, now), id, -1))
            return False
        self._used[(id, member)] = expires_at
        heapq.heappush(self._expiry, (expires_at, id, member))
        self._live[id] = self._live.get(id, 0) + 1
        self._where[(id, member)] = {"member": member, "worker": worker, "name": self._names.get(worker, worker),
                                     "key": key, "devices": [], "host": ""}
        return True

    def where(self, id: str) -> dict[str, Any]:
        """Where each member of ticket `id` ran (worker, name, devices), and each later attempt refused."""
        members = sorted((v for (t, _), v in self._where.items() if t == id), key=lambda v: v["member"])
        return {"members": members, "refused": list(self._refused.get(id, []))}

    def states(self, keys: list[str]) -> dict[str, Any]:
        """Each key's task state on the scheduler, and the worker it is processing on (None: not known there).

        The control plane's backstop: a run whose task sits in `no-worker` (its worker died and it is pinned
        there) or is gone is ended as lost, whatever events it missed.
        """
        out: dict[str, Any] = {}
        for key in keys:
            ts = self.scheduler.tasks.get(key) if self.scheduler is not None else None
            ws = getattr(ts, "processing_on", None) if ts is not None else None
            out[key] = None if ts is None else {"state": ts.state, "worker": getattr(ws, "address", None)}
        return out

    async def meet(self, id: str, member: int, hosts: int, host: str, port: int, wait: float = 1.0) -> list | None:
        """A gang member holds its devices: wait (up to `wait` s) until every member has; then each gets every
        member's (host, port), member 0's first. None: not all are there yet (ask again)."""
        if (id, member) not in self._used:
            raise ValueError(f"ticket {id[:8]} member {member} was not redeemed")
        gang = self._gangs.setdefault(id, {"members": {}, "event": asyncio.Event()})
        gang["members"][member] = [host, port]
        if len(gang["members"]) >= hosts:
            gang["event"].set()
        try:
            await asyncio.wait_for(gang["event"].wait(), wait)
        except asyncio.TimeoutError:
            return None
        return [gang["members"][m] for m in range(hosts)]

    def log_event(self, topic: str, msg: Any) -> None:
        if topic == PLACED_TOPIC and isinstance(msg, dict):
            entry = self._where.get((msg.get("ticket"), msg.get("member", 0)))
            if entry is not None:
                entry.update(devices=list(msg.get("devices", [])), host=msg.get("host", ""),
                             slurm_job=msg.get("slurm_job"))
        elif topic == "all" and isinstance(msg, dict) and msg.get("action") == "remove-worker":
            self._worker_died(msg.get("worker", ""), set(msg.get("processing-tasks", ())), bool(msg.get("expected")))

    def workers_left(self) -> dict[str, float]:
        """Worker address -> when it left (the scheduler's clock), for the newest LEFT_KEPT that left."""
        return dict(self._left)

    def _worker_died(self, worker: str, processing: set, expected: bool) -> None:
        """Every worker that leaves is told, whatever ran on it: one with only idle warm bodies took their device
        shares and idle time with it, and the control plane settles that time to now."""
        # Every run redeemed there whose ticket is live: one handed over straight to the worker is no Dask task
        # the scheduler was processing (its caller keeps only those it still follows).
        runs = [dict(v, ticket=t) for (t, _), v in self._where.items() if v["worker"] == worker]
        keys = sorted(str(k) for k in processing if str(k).startswith(KEY_PREFIX))
        now = time.time()
        self._left[worker] = now
        if len(self._left) > LEFT_KEPT:
            del self._left[next(iter(self._left))]
        if self.scheduler is None:
            return
        self.scheduler.log_event(DIED_TOPIC, {"worker": worker, "name": self._names.get(worker, worker),
                                              "expected": expected, "runs": runs, "keys": keys, "at": now})


def install_registry(client: Any) -> None:
    """Install the ticket registry on the client's scheduler (idempotent)."""
    client.register_plugin(TicketRegistry(), name=REGISTRY_NAME)
