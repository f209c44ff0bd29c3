"""The evidence log in the ledger: appending to its hash chain, reading it back, verifying and signing it."""

from __future__ import annotations

import hashlib
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
from aisched_prefect.ledger.schema import chain_head, checkpoints, evidence


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
