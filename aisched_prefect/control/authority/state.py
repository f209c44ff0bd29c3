"""The control plane's authority state, read from the evidence chain and nowhere else.

Credentials, applied configuration, delegated grants and revocations are each
an evidence record. This module folds those records into the state admission
reads, incrementally (only records after the last one seen), so every replica
on one database sees a revocation within one refresh, and editing or deleting a
row outside the chain changes nothing here: what is not in the chain does not
exist, and what the chain holds cannot be removed without breaking it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from aisched_prefect.control.authority import records
from aisched_prefect.control.authority.marks import (
    MARK_EVERY, MARK_KIND, Mark, StateDigest, authority_rows_through, intact, latest_mark)
from aisched_prefect.control.authority.identity import Credential
from aisched_prefect.evidence import GENESIS, EvidenceRecord, record_signed
from aisched_prefect.ledger import Ledger, chain_head, evidence
from blocks import ApprovalPolicyBlock, AuthorityBlock, BudgetBlock, ClusterBlock, Grant

logger = logging.getLogger("aisched_prefect.control")

CONFIG_KINDS: dict[str, type] = {
    "authority": AuthorityBlock, "budget": BudgetBlock, "policy": ApprovalPolicyBlock, "cluster": ClusterBlock,
}
READ_BATCH = 5_000  # records read at a time when the authority state catches up with the log
STATE_KINDS = ("credential-issued", "credential-revoked", "config-applied", "delegation", "revocation")


def content_digest(body: dict[str, Any]) -> str:
    """The digest an applied configuration is known by (block content, canonical JSON)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def block_body(block: Any) -> dict[str, Any]:
    """A block's own fields as JSON (what an operator edits), without Prefect's bookkeeping."""
    return json.loads(block.model_dump_json(include=set(type(block).model_fields)
                                            - {"_block_document_id", "_block_document_name", "_is_anonymous"}))


@dataclass(frozen=True)
class Applied:
    """One applied configuration: the block content a control plane acts on, and its version."""

    kind: str
    name: str
    version: int
    digest: str
    seq: int
    body: dict[str, Any]
    model: Any

    @property
    def ref(self) -> str:
        return f"{self.kind}:{self.name}@{self.version}"


@dataclass
class _Index:
    """Root grants of one applied authority config, by who holds them (built once per version)."""

    roots: dict[str, Grant]
    by_principal: dict[str, list[Grant]]
    groups: dict[str, list[str]]


@dataclass
class Snapshot:
    """Everything authority decisions read, at one instant. Immutable once built."""

    seq: int
    credentials: dict[str, Credential] = field(default_factory=dict)
    configs: dict[tuple[str, str], Applied] = field(default_factory=dict)
    delegated: dict[tuple[str | None, str], Grant] = field(default_factory=dict)
    """(authority name, grant id) -> a delegated grant: ids are unique within one authority, not across them."""
    delegated_to: dict[tuple[str | None, str], list[str]] = field(default_factory=dict)
    revoked: dict[tuple[str | None, str], dict[str, Any]] = field(default_factory=dict)
    """(authority name, grant id) -> who revoked it: grant ids are unique within one authority, not across them."""
    indexes: dict[tuple[str, int], _Index] = field(default_factory=dict)
    revoked_cache: dict[str, set[str]] = field(default_factory=dict)
    delegated_cache: dict[str, dict[str, Grant]] = field(default_factory=dict)

    def config(self, kind: str, name: str | None) -> Applied | None:
        return None if name is None else self.configs.get((kind, name))

    def index(self, authority: Applied) -> _Index:
        key = (authority.name, authority.version)
        idx = self.indexes.get(key)
        if idx is None:
            block: AuthorityBlock = authority.model
            by: dict[str, list[Grant]] = {}
            for g in block.grants:
                holders = block.groups.get(g.principal[6:], []) if g.principal.startswith("group:") else [g.principal]
                for p in holders:
                    by.setdefault(p, []).append(g)
            idx = self.indexes[key] = _Index({g.id: g for g in block.grants}, by, dict(block.groups))
        return idx

    def revoked_in(self, authority: Applied) -> set[str]:
        """Ids revoked under this authority (a revocation naming no authority, from before they were named, counts
        everywhere). Computed once per snapshot and authority: admission reads it for every run."""
        cached = self.revoked_cache.get(authority.name)
        if cached is None:
            cached = self.revoked_cache[authority.name] = {gid for (name, gid) in self.revoked
                                                           if name in (None, authority.name)}
        return cached

    def delegated_in(self, authority: Applied) -> dict[str, Grant]:
        """The grants delegated under this authority (a delegation naming none, from before they were named, counts
        in each), by id. Computed once per snapshot and authority."""
        cached = self.delegated_cache.get(authority.name)
        if cached is None:
            cached = self.delegated_cache[authority.name] = {
                gid: g for (name, gid), g in self.delegated.items() if name in (None, authority.name)}
        return cached

    def grants_of(self, authority: Applied, principal: str) -> list[Grant]:
        """Every grant `principal` holds under this authority: roots issued to it, then grants delegated to it there."""
        idx = self.index(authority)
        mine = self.delegated_in(authority)
        ids = [*self.delegated_to.get((authority.name, principal), []), *self.delegated_to.get((None, principal), [])]
        return [*idx.by_principal.get(principal, []), *(mine[g] for g in ids if g in mine)]


def _after(seen: int, last: int | None = None) -> sa.Select:
    """The next READ_BATCH records after record `seen` (up to `last`), in order."""
    query = sa.select(evidence).where(evidence.c.seq > seen)
    if last is not None:
        query = query.where(evidence.c.seq <= last)
    return query.order_by(evidence.c.seq).limit(READ_BATCH)


class AuthorityState:
    """The folded chain. `refresh()` reads only records appended since the last call, and checks each one.

    Every record must follow the one before it (seq, previous hash, its own hash), and a record
    that carries authority must be signed by a trusted key (the control plane's own): a row deleted,
    edited, or written by anyone else with access to the database breaks the fold. A broken fold
    stops here, keeps the state it had, and says so (`broken`): admission then admits nothing.
    """

    def __init__(self, ledger: Ledger, trusted: list[bytes] | None = None) -> None:
        self.ledger = ledger
        self.trusted = list(trusted or [])
        self._lock = threading.Lock()
        self._snap = Snapshot(seq=0)
        self._hash = GENESIS
        self._seen = 0  # the last record checked (of any kind); the snapshot's seq is its last authority record
        self._digest = StateDigest()  # of the authority records folded so far (what a mark signs)
        self.marked_through = 0  # the `through` of the newest mark this state started from or wrote
        self._read_at = float("-inf")  # when the last refresh that read the log to its end began (monotonic)
        self.broken: str | None = None

    @property
    def snapshot(self) -> Snapshot:
        return self._snap

    def refresh(self) -> Snapshot:
        """Check and fold the records appended since the last call. A new snapshot is made only when one of them
        carries authority: admission reads caches of the snapshot (delegated and revoked grants, indexes).

        Calls that wait while another refreshes share the next read: a read that began after a call was made saw
        every record committed before it, so that call returns its snapshot without a read of its own (a burst of
        admissions reads the log twice, not once each)."""
        asked = time.monotonic()
        with self._lock:
            old = self._snap
            if self.broken is not None or self._read_at > asked:
                return old
            began = time.monotonic()
            if self._seen == 0 and self.trusted:
                self._start_from_mark()
                old = self._snap
                if self.broken is not None:
                    return old
            seen = self._seen
            with self.ledger.reader.connect() as conn:
                # The head first: every record up to it was committed with it, so a shorter log was truncated.
                head = conn.execute(sa.select(chain_head.c.seq, chain_head.c.hash)).first()
                rows = conn.execute(_after(seen)).all()  # an admission's refresh: all there is, in one read
                last = (rows[-1].seq if rows else seen) if len(rows) < READ_BATCH else \
                    conn.execute(sa.select(sa.func.max(evidence.c.seq))).scalar()
            if head is not None and head.seq > last:
                self._break(f"the log ends at record {last} but its head says {head.seq}: truncated")
                return old
            snap: Snapshot | None = None
            prev = self._hash
            for row in itertools.chain(rows, self._rows_after(rows[-1].seq if rows else seen, last)):
                record = EvidenceRecord.model_construct(**row._mapping)
                why = self._problem(record, seen, prev)
                if why is not None:
                    self._break(why)
                    break
                if record.kind in STATE_KINDS:
                    self._digest.add(record.seq, record.hash)
                    if snap is None:
                        snap = Snapshot(seq=old.seq, credentials=dict(old.credentials), configs=dict(old.configs),
                                        delegated=dict(old.delegated),
                                        delegated_to={k: list(v) for k, v in old.delegated_to.items()},
                                        revoked=dict(old.revoked), indexes=dict(old.indexes))
                    payload = record.payload if isinstance(record.payload, dict) else json.loads(record.payload)
                    _fold(snap, record.seq, record.kind, payload)
                    snap.seq = record.seq
                seen, prev = record.seq, record.hash
            self._seen, self._hash = seen, prev
            if snap is not None:
                self._snap = snap
            if self.broken is None:
                self._read_at = began  # (a read that failed, or a fold that broke, serves nobody else)
            return self._snap

    def _start_from_mark(self) -> None:
        """Start from the newest mark a trusted key signed (control.authority.marks); without one, from the first
        record, as before. Every authority record up to the mark must be intact, signed, and together make its count
        and digest: otherwise the fold is broken (`broken`), as a broken chain is. Called with the lock held."""
        with self.ledger.reader.connect() as conn:
            mark = latest_mark(conn, self.trusted, STATE_KINDS)
            rows = authority_rows_through(conn, STATE_KINDS, mark.through) if mark is not None else []
        if mark is None:
            return
        digest, snap = StateDigest(), Snapshot(seq=0)
        for row in rows:
            record = EvidenceRecord.model_construct(**row._mapping)
            if not intact(record):
                return self._break(f"record {record.seq} ({record.kind}) does not match its hash: edited")
            if not record_signed(record, self.trusted):
                return self._break(f"record {record.seq} ({record.kind}) is not signed by this control plane's key: "
                                   "written by someone else")
            digest.add(record.seq, record.hash)
            payload = record.payload if isinstance(record.payload, dict) else json.loads(record.payload)
            _fold(snap, record.seq, record.kind, payload)
            snap.seq = record.seq
        if (digest.count, digest.hexdigest()) != (mark.state_records, mark.state_digest):
            return self._break(f"the authority records up to record {mark.through} are not those its signed mark "
                               f"names ({digest.count} of {mark.state_records}): deleted, added or rewritten")
        self._snap, self._digest, self._seen, self._hash = snap, digest, mark.through, mark.through_hash
        self.marked_through = mark.through

    def _break(self, why: str) -> None:
        self.broken = why
        logger.critical("the evidence log is broken: %s; admitting nothing until it is restored", why)

    def mark(self) -> Mark | None:
        """Write a mark through the last record checked, when MARK_EVERY records were checked since the last one
        (a plane starting later reads only the authority records before it); the mark written, or None."""
        self.refresh()
        with self._lock:
            if self.broken is not None or not self.trusted or self._seen - self.marked_through < MARK_EVERY:
                return None
            mark = Mark(through=self._seen, through_hash=self._hash, state_records=self._digest.count,
                        state_digest=self._digest.hexdigest(), kinds=list(STATE_KINDS))
        self.ledger.record(MARK_KIND, mark.model_dump())  # outside the lock: a slow ledger holds up no admission
        with self._lock:
            self.marked_through = max(self.marked_through, mark.through)
        return mark

    def _rows_after(self, seen: int, last: int) -> Iterator[Any]:
        """The records after `seen` up to `last`, READ_BATCH at a time: a plane starting on a ledger of millions of
        records checks them all, holding a batch in memory, not the log."""
        while seen < last:
            with self.ledger.reader.connect() as conn:
                rows = conn.execute(_after(seen, last)).all()
            if not rows:
                return
            yield from rows
            seen = rows[-1].seq

    def _problem(self, r: EvidenceRecord, last_seq: int, last_hash: str) -> str | None:
        if r.seq != last_seq + 1 or r.prev_hash != last_hash:
            return f"record {r.seq} does not follow record {last_seq}: deleted, reordered or rewritten"
        if not intact(r):  # (its prev_hash is last_hash: checked above)
            return f"record {r.seq} does not match its hash: edited"
        if self.trusted and r.kind in STATE_KINDS and not record_signed(r, self.trusted):
            return f"record {r.seq} ({r.kind}) is not signed by this control plane's key: written by someone else"
        return None


def _fold(snap: Snapshot, seq: int, kind: str, payload: dict[str, Any]) -> None:
    try:
        p = records.parse(kind, payload)
    except ValueError:  # a record that does not validate grants nothing
        return
    if isinstance(p, records.CredentialIssued):
        snap.credentials[p.credential.id] = p.credential
    elif isinstance(p, records.CredentialRevoked):
        cred = snap.credentials.get(p.id)
        if cred is not None:
            snap.credentials[cred.id] = cred.model_copy(update={"revoked": True})
    elif isinstance(p, records.ConfigApplied):
        snap.configs[(p.config_kind, p.name)] = Applied(
            kind=p.config_kind, name=p.name, version=p.version, digest=p.digest, seq=seq, body=p.body,
            model=CONFIG_KINDS[p.config_kind].model_validate(p.body))
    elif isinstance(p, records.Delegation):
        if (p.authority, p.grant.id) not in snap.delegated:
            snap.delegated[(p.authority, p.grant.id)] = p.grant
            snap.delegated_to.setdefault((p.authority, p.grant.principal), []).append(p.grant.id)
    elif isinstance(p, records.Revocation):
        snap.revoked.setdefault((p.authority, p.grant), {"by": p.by, "reason": p.reason, "seq": seq})
