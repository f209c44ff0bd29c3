"""Evidence records and their hash chain: pure functions, checked offline by `aisched evidence verify`."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict

GENESIS = "0" * 64

KINDS = ("admission", "denial", "approval-requested", "approval", "settlement", "delegation",
         "delegation-refused", "revocation")


class EvidenceRecord(BaseModel):
    """One decision: who, what, which grant, which policy, budget before/after, placement, outcome."""

    model_config = ConfigDict(frozen=True)

    seq: int
    ts: float
    kind: str
    flow_run_id: str | None
    task_run_id: str | None
    principal: str | None
    payload: dict[str, Any]
    prev_hash: str
    hash: str


def canonical(seq: int, ts: float, kind: str, flow_run_id: str | None, task_run_id: str | None,
              principal: str | None, payload: dict[str, Any]) -> bytes:
    body = {
        "seq": seq, "ts": repr(float(ts)), "kind": kind, "flow_run_id": flow_run_id,
        "task_run_id": task_run_id, "principal": principal, "payload": payload,
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()


def chain_hash(prev_hash: str, body: bytes) -> str:
    return hashlib.sha256(prev_hash.encode() + body).hexdigest()


SIG = "sig"
"""The payload key of a record's signature: the writer's Ed25519 signature over the record's canonical body
(seq, ts, kind, ids and payload without it), so a record copied elsewhere, or written by anyone else, fails."""


def signing_body(seq: int, ts: float, kind: str, flow_run_id: str | None, task_run_id: str | None,
                 principal: str | None, payload: dict[str, Any]) -> bytes:
    return b"aisched-record/1\n" + canonical(seq, ts, kind, flow_run_id, task_run_id, principal,
                                             {k: v for k, v in payload.items() if k != SIG})


def record_signed(record: EvidenceRecord, public_keys: list[bytes]) -> bool:
    """Whether the record carries a valid signature by one of `public_keys`."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    sig = record.payload.get(SIG) if isinstance(record.payload, dict) else None
    if not isinstance(sig, str):
        return False
    body = signing_body(record.seq, record.ts, record.kind, record.flow_run_id, record.task_run_id, record.principal,
                        record.payload)
    for key in public_keys:
        try:
            Ed25519PublicKey.from_public_bytes(key).verify(bytes.fromhex(sig), body)
            return True
        except (InvalidSignature, ValueError):
            continue
    return False


def verify_signatures(records: list[EvidenceRecord], public_keys: list[bytes]) -> ChainReport:
    """Every record must be signed by one of the keys: the log of a control plane has no record it did not write."""
    for r in records:
        if not record_signed(r, public_keys):
            return ChainReport(ok=False, records=len(records), at_seq=r.seq,
                               problem=f"record {r.seq} ({r.kind}) is not signed by the control plane's key: "
                                       "written by someone else")
    return ChainReport(ok=True, records=len(records))


class ChainReport(BaseModel):
    """Result of checking a log: ok, or the first record where it breaks and why."""

    ok: bool
    records: int
    problem: str | None = None
    at_seq: int | None = None


def verify_chain(records: list[EvidenceRecord], head: tuple[int, str] | None) -> ChainReport:
    """Detect any edit, deletion, reordering or truncation of the log.

    `head` is the (seq, hash) the ledger recorded for its last append; without it
    a truncated tail would look like a shorter, valid log.
    """
    prev = GENESIS
    for expected_seq, r in enumerate(records, start=1):
        if r.seq != expected_seq:
            return ChainReport(ok=False, records=len(records), at_seq=r.seq,
                               problem=f"expected record {expected_seq}, found {r.seq}: deleted or reordered")
        if r.prev_hash != prev:
            return ChainReport(ok=False, records=len(records), at_seq=r.seq,
                               problem="prev_hash does not match the record before: reordered or edited")
        body = canonical(r.seq, r.ts, r.kind, r.flow_run_id, r.task_run_id, r.principal, r.payload)
        if chain_hash(prev, body) != r.hash:
            return ChainReport(ok=False, records=len(records), at_seq=r.seq,
                               problem="hash does not match the record's content: edited")
        prev = r.hash
    last = (records[-1].seq, records[-1].hash) if records else (0, GENESIS)
    if head is not None and tuple(head) != last:
        return ChainReport(ok=False, records=len(records), at_seq=head[0],
                           problem=f"log ends at record {last[0]} but the ledger head says {head[0]}: truncated")
    return ChainReport(ok=True, records=len(records))


class Checkpoint(BaseModel):
    """A signed statement that the log had `hash` at record `seq`: rewriting history below it is detectable."""

    model_config = ConfigDict(frozen=True)

    seq: int
    hash: str
    key_id: str
    signature: str
    ts: float


def checkpoint_body(seq: int, hash_: str) -> bytes:
    return f"aisched-evidence-checkpoint/1:{seq}:{hash_}".encode()


def verify_checkpoints(records: list[EvidenceRecord], checkpoints: list[Checkpoint], public_key: bytes) -> ChainReport:
    """Each checkpoint must be signed by `public_key` and match the log at its record.

    The chain alone cannot tell a cleanly truncated log (head row rewritten to
    match) from a shorter one; a signed checkpoint past the new end can.
    """
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    verifier = Ed25519PublicKey.from_public_bytes(public_key)
    by_seq = {r.seq: r for r in records}
    for cp in checkpoints:
        try:
            verifier.verify(bytes.fromhex(cp.signature), checkpoint_body(cp.seq, cp.hash))
        except (InvalidSignature, ValueError):
            return ChainReport(ok=False, records=len(records), at_seq=cp.seq,
                               problem=f"checkpoint at record {cp.seq} is not signed by this key: forged or altered")
        if cp.seq not in by_seq:
            return ChainReport(ok=False, records=len(records), at_seq=cp.seq,
                               problem=f"signed checkpoint at record {cp.seq} is past the end of the log: truncated")
        if by_seq[cp.seq].hash != cp.hash:
            return ChainReport(ok=False, records=len(records), at_seq=cp.seq,
                               problem=f"record {cp.seq} differs from its signed checkpoint: history rewritten")
    return ChainReport(ok=True, records=len(records))


def verify_published(records: list[EvidenceRecord], where: str, public_key: bytes | None = None) -> ChainReport:
    """Check the log against a checkpoint the control plane published outside its database.

    `where` is a checkpoint file or the directory the control plane publishes to
    (its `latest.json`). A directory with no checkpoint fails: checkpoints were
    configured, so their absence is itself the problem (deleted, or never written).
    """
    import os

    path = os.path.join(where, "latest.json") if os.path.isdir(where) else where
    if not os.path.exists(path):
        return ChainReport(ok=False, records=len(records),
                           problem=f"no published checkpoint at {path}: checkpoints are configured but none was found")
    with open(path) as f:
        data = json.load(f)
    if public_key is None:
        return ChainReport(ok=False, records=len(records), at_seq=data.get("seq"),
                           problem="no key to check the published checkpoint against: the key written inside it "
                                   "proves nothing (pass the control plane's public key)")
    if bytes.fromhex(data.get("public_key", "")) != public_key:
        return ChainReport(ok=False, records=len(records), at_seq=data.get("seq"),
                           problem="the published checkpoint names another key than the control plane's")
    cp = Checkpoint(**{k: data[k] for k in Checkpoint.model_fields})
    report = verify_checkpoints(records, [cp], public_key)
    return report if not report.ok else ChainReport(ok=True, records=len(records), at_seq=cp.seq)


def extends(records: list[EvidenceRecord], seq: int, hash_: str) -> str | None:
    """Why `records` (ascending, from record `seq` on) do not extend the log that had `hash_` at `seq`, or None.

    What a signer checks before it signs a new head: the log it signs must still hold
    what it signed before, unchanged, and grow from there hash by hash.
    """
    if seq == 0:
        prev = GENESIS
        rest = records
    else:
        if not records or records[0].seq != seq or records[0].hash != hash_:
            return f"record {seq} is no longer the one checkpointed ({hash_[:12]}...): history rewritten or truncated"
        prev, rest = hash_, records[1:]
    expected = seq + 1
    for r in rest:
        if r.seq != expected or r.prev_hash != prev:
            return f"record {r.seq} does not follow record {expected - 1}: deleted, reordered or rewritten"
        if chain_hash(prev, canonical(r.seq, r.ts, r.kind, r.flow_run_id, r.task_run_id, r.principal, r.payload)) != r.hash:
            return f"record {r.seq} does not match its hash: edited"
        prev, expected = r.hash, expected + 1
    return None
