"""The evidence log in the ledger: appending to its hash chain, reading it back, verifying and signing it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from sqlalchemy.engine import Connection, Engine

from aisched_prefect.evidence import (
    SIG,
    ChainReport,
    Checkpoint,
    EvidenceRecord,
    canonical,
    chain_hash,
    checkpoint_body,
    signing_body,
    verify_chain,
    verify_checkpoints,
    verify_signatures,
)
from aisched_prefect.errors import InvalidLedgerInput
from aisched_prefect.ledger.schema import chain_head, checkpoints, evidence

ID_LENGTHS = {"flow_run_id": 64, "task_run_id": 64, "principal": 200}
KIND_LENGTH = 32


def check_ids(kind: str, ids: dict[str, Any]) -> None:
    """A record's kind and ids fit their columns on every backend (Postgres refuses what SQLite would keep)."""
    if not isinstance(kind, str) or not 0 < len(kind) <= KIND_LENGTH or "\x00" in kind:
        raise InvalidLedgerInput("kind", kind, f"a record kind is 1 to {KIND_LENGTH} characters, no NUL byte",
                                 "name the record's kind, e.g. 'admission'")
    for name, longest in ID_LENGTHS.items():
        value = ids.get(name)
        if value is not None and (not isinstance(value, str) or len(value) > longest or "\x00" in value):
            raise InvalidLedgerInput(name, value, f"an id is a string of at most {longest} characters, no NUL byte",
                                     f"pass the {name.replace('_', ' ')} as Prefect or the credential names it")


def payload_json(kind: str, payload: dict[str, Any]) -> str:
    """The payload as the JSON text stored: plain JSON only, the same on SQLite and Postgres.

    NaN and infinities are not JSON (SQLite would keep them, Postgres refuses them): refused here, naming the key.
    """
    try:
        return json.dumps(payload, allow_nan=False)
    except ValueError:
        raise InvalidLedgerInput(f"payload of {kind!r}", _nonfinite(payload),
                                 "evidence is stored as JSON: every number must be finite, not NaN or infinite",
                                 "pass finite numbers (or None) in the record's payload") from None
    except TypeError as exc:
        raise InvalidLedgerInput(f"payload of {kind!r}", type(payload).__name__, f"evidence is stored as JSON ({exc})",
                                 "pass only JSON values (str, numbers, bools, None, lists, dicts)") from None


def _nonfinite(value: Any, path: str = "payload") -> str:
    """Where the first NaN or infinite number is, e.g. 'payload.usage.cost=nan'."""
    if isinstance(value, float) and value != value or value in (float("inf"), float("-inf")):
        return f"{path}={value}"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for k, v in items:
        found = _nonfinite(v, f"{path}.{k}" if isinstance(value, dict) else f"{path}[{k}]")
        if found:
            return found
    return ""


def next_record(head: tuple[int, str], ts: float, kind: str, payload: dict[str, Any], ids: dict[str, Any],
                signer: Callable[[bytes], str] | None = None) -> dict[str, Any]:
    """The row that follows `head` in the chain: its seq, the previous hash, and its own (and, with a signer,
    the writer's signature in the payload, under the hash)."""
    seq, prev = head[0] + 1, head[1]
    if signer is not None:
        payload = {**payload, SIG: signer(signing_body(seq, ts, kind, ids["flow_run_id"], ids["task_run_id"],
                                                       ids["principal"], payload))}
    h = chain_hash(prev, canonical(seq, ts, kind, ids["flow_run_id"], ids["task_run_id"], ids["principal"], payload))
    return dict(seq=seq, ts=ts, kind=kind, payload=payload, prev_hash=prev, hash=h, **ids)


def read_records(conn: Connection, flow_run_id: str | None = None) -> list[EvidenceRecord]:
    q = sa.select(evidence).order_by(evidence.c.seq)
    if flow_run_id is not None:
        q = q.where(evidence.c.flow_run_id == flow_run_id)
    # Rows come from our own table: construct without re-validating (the chain check is the validation).
    return [EvidenceRecord.model_construct(**row._mapping) for row in conn.execute(q)]


def records_about(reader: Engine, run_id: str) -> list[EvidenceRecord]:
    """Records of a flow run or of a task run, in order."""
    q = sa.select(evidence).where((evidence.c.flow_run_id == run_id) | (evidence.c.task_run_id == run_id))
    with reader.connect() as conn:
        return [EvidenceRecord.model_construct(**row._mapping) for row in conn.execute(q.order_by(evidence.c.seq))]


def verify(reader: Engine, public_key: bytes | None = None, signed_records: bool = False) -> ChainReport:
    """Check the chain; with the control plane's public key, its signed checkpoints too, and (`signed_records`)
    that it signed every record."""
    with reader.connect() as conn:  # one snapshot: the head and the log it should end at
        head = conn.execute(sa.select(chain_head.c.seq, chain_head.c.hash)).first()
        records = read_records(conn)
        report = verify_chain(records, tuple(head) if head else None)
        if not report.ok or public_key is None:
            return report
        signed = [Checkpoint(**row._mapping) for row in conn.execute(sa.select(checkpoints).order_by(checkpoints.c.seq))]
    if signed_records:
        report = verify_signatures(records, [public_key])
        if not report.ok:
            return report
    return verify_checkpoints(records, signed, public_key)


def checkpoint_op(private_key: Ed25519PrivateKey) -> Any:
    """A write that signs the current head of the log and keeps the signature in the ledger."""
    public = private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    key_id = hashlib.sha256(public).hexdigest()[:16]

    def op(w: Any) -> Checkpoint:
        seq, head = w.head
        cp = Checkpoint(seq=seq, hash=head, key_id=key_id, ts=w.now,
                        signature=private_key.sign(checkpoint_body(seq, head)).hex())
        if w.conn.execute(sa.select(checkpoints.c.seq).where(checkpoints.c.seq == seq)).first() is None:
            w.conn.execute(checkpoints.insert().values(**cp.model_dump()))
        return cp

    return op
