"""Authority marks: where a control plane may start folding the evidence log without checking it all again.

Why: every control plane starts by folding the whole log into its authority state, checking each record's hash and
the chain between them. An embedded plane does that for every flow run, and the log grows with every run (about four
records a shard: a nightly 10,000-shard map adds 40,000), so a flow run's start grew with the project's history
(176,557 records: 11 s of CPU before the first admission).

A mark is an evidence record of its own (kind `authority-mark`), in the chain and signed by the plane's key, that
names a record (`through`), that record's hash, and the count and digest of every authority record up to it. A
plane that trusts the mark's key starts there: it reads only the authority records up to `through` (an index on
kind and seq), checks each one's own hash and signature and that together they make the mark's digest (a deleted,
added, edited or reordered authority record changes it), folds them, and checks every record after `through` as
before (each follows the one before it from the mark's hash on). The records between that are not authority
(holds, settlements, runs) are not read again at start: `aisched evidence verify` checks the whole chain. A mark
whose digest does not match is not used: the plane checks the whole log, as before, and finds what broke it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict

from aisched_prefect.evidence import EvidenceRecord, canonical, chain_hash, record_signed
from aisched_prefect.ledger import evidence

MARK_KIND = "authority-mark"
MARK_EVERY = 10_000  # records checked since the last mark before a plane writes another


class Mark(BaseModel):
    """What a mark says: the authority records up to `through` (their count and digest) and the hash it ends on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    through: int
    through_hash: str
    state_records: int
    state_digest: str


class StateDigest:
    """The running digest of the authority records folded so far: each one's seq and hash, in order."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self.count = 0

    def add(self, seq: int, record_hash: str) -> None:
        self._h.update(f"{seq}:{record_hash}\n".encode())
        self.count += 1

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def latest_mark(conn: Any, trusted: list[bytes]) -> Mark | None:
    """The newest mark this plane can start from: its own hash right and signed by a trusted key (else None)."""
    row = conn.execute(sa.select(evidence).where(evidence.c.kind == MARK_KIND)
                       .order_by(evidence.c.seq.desc()).limit(1)).first()
    if row is None or not trusted:
        return None
    record = EvidenceRecord.model_construct(**row._mapping)
    if not intact(record) or not record_signed(record, trusted):
        return None
    try:
        mark = Mark.model_validate({k: v for k, v in record.payload.items() if k in Mark.model_fields})
    except (ValueError, AttributeError):
        return None
    return mark if mark.through < record.seq else None


def intact(record: EvidenceRecord) -> bool:
    """Whether a record's content still makes its hash (from the hash it says came before it)."""
    return chain_hash(record.prev_hash, canonical(record.seq, record.ts, record.kind, record.flow_run_id,
                                                  record.task_run_id, record.principal, record.payload)) == record.hash


def authority_rows_through(conn: Any, kinds: tuple[str, ...], through: int) -> list[Any]:
    """Every authority record up to `through`, in order (the kind-and-seq index: not the log)."""
    return conn.execute(sa.select(evidence).where(evidence.c.kind.in_(kinds) & (evidence.c.seq <= through))
                        .order_by(evidence.c.seq)).all()
