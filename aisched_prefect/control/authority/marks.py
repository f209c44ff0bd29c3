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
(holds, settlements, runs) are not read again at start: `aisched evidence verify` checks the whole chain.

A signed mark whose authority records are not as it says breaks the fold (the plane admits nothing), as a broken
chain does: an honest plane marks only what it checked, so the records changed after it was written. Falling back to
the whole log would be weaker than the mark: a record's signature does not cover the hash before it, so a log whose
non-authority records were rewritten around a deleted revocation can check whole again, while the mark's digest
still names the revocation. A mark written over other authority kinds (another version) is not used.
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
    kinds: list[str]
    """The kinds of record the digest covers (a plane whose authority kinds differ does not use the mark)."""


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


LOOK_BACK = 8  # marks read, newest first, for one this plane can use (a forged one appended last hides none)


def latest_mark(conn: Any, trusted: list[bytes], kinds: tuple[str, ...]) -> Mark | None:
    """The newest mark this plane can start from: its own hash right, signed by a trusted key and over the same
    authority kinds (else None: the whole log is checked)."""
    if not trusted:
        return None
    rows = conn.execute(sa.select(evidence).where(evidence.c.kind == MARK_KIND)
                        .order_by(evidence.c.seq.desc()).limit(LOOK_BACK)).all()
    for row in rows:
        record = EvidenceRecord.model_construct(**row._mapping)
        if not intact(record) or not record_signed(record, trusted):
            continue
        try:
            mark = Mark.model_validate({k: v for k, v in record.payload.items() if k in Mark.model_fields})
        except (ValueError, AttributeError):
            continue
        if mark.through < record.seq and tuple(mark.kinds) == tuple(kinds):
            return mark
    return None


def intact(record: EvidenceRecord) -> bool:
    """Whether a record's content still makes its hash (from the hash it says came before it). A row whose columns
    are not of their types (written around the ledger) is not intact: it is no crash."""
    if not (isinstance(record.prev_hash, str) and isinstance(record.hash, str) and isinstance(record.seq, int)):
        return False
    try:
        body = canonical(record.seq, record.ts, record.kind, record.flow_run_id, record.task_run_id,
                         record.principal, record.payload)
    except (TypeError, ValueError, AttributeError):
        return False
    return chain_hash(record.prev_hash, body) == record.hash


def authority_rows_through(conn: Any, kinds: tuple[str, ...], through: int) -> list[Any]:
    """Every authority record up to `through`, in order (the kind-and-seq index: not the log)."""
    return conn.execute(sa.select(evidence).where(evidence.c.kind.in_(kinds) & (evidence.c.seq <= through))
                        .order_by(evidence.c.seq)).all()
