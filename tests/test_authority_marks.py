"""A control plane starts folding the evidence log at its newest authority mark (control.authority.marks), and only
where every authority record before the mark is as the mark says: start-up no longer grows with the log's history,
and an authority record deleted, edited or forged before the mark is still found."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from aisched_prefect import Ledger
from aisched_prefect.control.authority import marks
from aisched_prefect.control.authority.state import STATE_KINDS, AuthorityState
from aisched_prefect.evidence import EvidenceRecord, canonical, chain_hash
from aisched_prefect.ledger import chain_head, evidence
from dask_gpu.tickets import TicketSigner


@pytest.fixture
def signed(tmp_path, monkeypatch):
    """A ledger whose records the plane's key signs, with revocations of g0..g2 among 30 records of other kinds,
    and a mark through them all (MARK_EVERY lowered so a small log makes one)."""
    monkeypatch.setattr(marks, "MARK_EVERY", 10)
    monkeypatch.setattr("aisched_prefect.control.authority.state.MARK_EVERY", 10)
    signer = TicketSigner(Ed25519PrivateKey.generate())
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}", signer=signer.sign)
    for i in range(30):
        if i % 10 == 5:
            ledger.record("revocation", {"grant": f"g{i // 10}", "authority": "team", "by": "op", "reason": "incident"})
        else:
            ledger.record("settled", {"n": i}, flow_run_id="f", task_run_id=f"t{i}")
    state = AuthorityState(ledger, trusted=[signer.public_key])
    state.refresh()
    mark = state.mark()
    assert mark is not None and mark.through == 30 and mark.state_records == 3
    assert state.mark() is None  # nothing new since: no second mark
    yield ledger, signer
    ledger.close()


def _revoked(state: AuthorityState) -> set[str]:
    return {gid for (_, gid) in state.snapshot.revoked}


def _rows(ledger: Ledger, kind: str) -> list[dict]:
    with ledger.engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(sa.select(evidence).where(evidence.c.kind == kind)
                                                       .order_by(evidence.c.seq))]


def test_a_plane_starts_at_the_mark_and_checks_every_record_after_it(signed):
    ledger, signer = signed
    ledger.record("revocation", {"grant": "g9", "authority": "team", "by": "op", "reason": "after the mark"})
    state = AuthorityState(ledger, trusted=[signer.public_key])
    state.refresh()
    assert state.broken is None and state.marked_through == 30
    assert _revoked(state) == {"g0", "g1", "g2", "g9"}  # the same fold as from the first record
    full = AuthorityState(ledger, trusted=[])  # no trusted key: no mark is used, the whole log is checked
    full.refresh()
    assert full.marked_through == 0 and _revoked(full) == _revoked(state)
    # A record after the mark, edited, still stops the fold as before.
    (last,) = [r for r in _rows(ledger, "revocation") if r["payload"]["grant"] == "g9"]
    with ledger.engine.begin() as conn:
        conn.execute(sa.update(evidence).where(evidence.c.seq == last["seq"])
                     .values(payload={**last["payload"], "grant": "g8"}))
    again = AuthorityState(ledger, trusted=[signer.public_key])
    again.refresh()
    assert again.broken is not None and "edited" in again.broken


@pytest.mark.parametrize("attack", ["delete", "edit", "rehash"])
def test_an_authority_record_changed_before_the_mark_is_found(signed, attack):
    """Deleted: the mark's count and digest no longer match; edited: its hash no longer matches its content;
    edited and hashed again by someone without the plane's key: its signature no longer matches. Each time the fold
    is broken, naming why, and nothing is folded (admission admits nothing), as with a broken chain."""
    ledger, signer = signed
    (row,) = [r for r in _rows(ledger, "revocation") if r["payload"]["grant"] == "g1"]
    with ledger.engine.begin() as conn:
        if attack == "delete":
            conn.execute(sa.delete(evidence).where(evidence.c.seq == row["seq"]))
        else:
            payload = {**row["payload"], "grant": "g7"}
            new_hash = chain_hash(row["prev_hash"], canonical(row["seq"], row["ts"], row["kind"], row["flow_run_id"],
                                                              row["task_run_id"], row["principal"], payload))
            conn.execute(sa.update(evidence).where(evidence.c.seq == row["seq"])
                         .values(payload=payload, **({"hash": new_hash} if attack == "rehash" else {})))
    state = AuthorityState(ledger, trusted=[signer.public_key])
    state.refresh()
    why = {"delete": "not those its signed mark names", "edit": "edited", "rehash": "not signed"}[attack]
    assert state.marked_through == 0 and state.broken is not None and why in state.broken
    assert _revoked(state) == set()
    state.refresh()  # and stays broken: nothing after is read
    assert state.broken is not None and state.snapshot.seq == 0


def _forge_at(ledger: Ledger, seq: int, kind: str, payload: dict, *, rehash_from_here: bool) -> None:
    """Replace record `seq` with one of someone's own (no plane key), its hash right; with `rehash_from_here`, every
    record after it hashed again from it, the chain head too (what someone with the database and no key can do)."""
    with ledger.engine.begin() as conn:
        rows = [dict(r._mapping) for r in conn.execute(sa.select(evidence).where(evidence.c.seq >= seq)
                                                       .order_by(evidence.c.seq))]
        prev = rows[0]["prev_hash"]
        for i, row in enumerate(rows):
            if i == 0:
                row = {**row, "kind": kind, "payload": payload}
            elif not rehash_from_here:
                break
            h = chain_hash(prev, canonical(row["seq"], row["ts"], row["kind"], row["flow_run_id"], row["task_run_id"],
                                           row["principal"], row["payload"]))
            conn.execute(sa.update(evidence).where(evidence.c.seq == row["seq"])
                         .values(kind=row["kind"], payload=row["payload"], prev_hash=prev, hash=h))
            prev = h
        if rehash_from_here:
            conn.execute(sa.update(chain_head).where(chain_head.c.id == 1).values(hash=prev))


def test_a_forged_authority_record_after_the_last_genuine_one_before_the_mark_breaks_the_fold(signed):
    """A record of another kind (a settlement after the last revocation) made into an unsigned grant: the records
    before it still make the mark's digest, but it is an authority record up to the mark that is not signed."""
    ledger, signer = signed
    (row,) = [r for r in _rows(ledger, "settled") if r["payload"]["n"] == 28]
    _forge_at(ledger, row["seq"], "delegation", {"grant": {"id": "mine", "principal": "tenant-b"}},
              rehash_from_here=False)
    state = AuthorityState(ledger, trusted=[signer.public_key])
    state.refresh()
    assert state.broken is not None and "not signed" in state.broken and state.marked_through == 0


def test_a_revocation_deleted_by_rewriting_the_chain_around_it_is_found_by_the_mark(signed):
    """The last revocation before the mark replaced by a settlement and every record after it hashed again: each
    record still follows the one before it and every authority record left is signed (signatures do not cover the
    hash before a record), so the chain alone checks whole; the signed mark still counts the revocation."""
    ledger, signer = signed
    (row,) = [r for r in _rows(ledger, "revocation") if r["payload"]["grant"] == "g2"]
    _forge_at(ledger, row["seq"], "settled", {"n": -1}, rehash_from_here=True)
    assert ledger.verify().ok  # the chain alone: whole
    state = AuthorityState(ledger, trusted=[signer.public_key])
    state.refresh()
    assert state.broken is not None and "not those its signed mark names" in state.broken


def test_a_mark_over_other_authority_kinds_is_not_used(signed, monkeypatch):
    """A plane whose authority kinds differ from those a mark was written over (another version) checks the whole
    log: the mark's digest covers other records, and is neither used nor taken as a break."""
    ledger, signer = signed
    monkeypatch.setattr("aisched_prefect.control.authority.state.STATE_KINDS",
                        (*STATE_KINDS, "another-kind"))
    state = AuthorityState(ledger, trusted=[signer.public_key])
    state.refresh()
    assert state.broken is None and state.marked_through == 0 and _revoked(state) == {"g0", "g1", "g2"}


def test_a_row_whose_columns_are_not_their_types_is_not_intact():
    """Written around the ledger: a hash that is no string, a seq that is no number. Not intact, and no crash."""
    good = dict(seq=1, ts=1.0, kind="revocation", flow_run_id=None, task_run_id=None, principal=None,
                payload={"grant": "g"}, prev_hash="0" * 64)
    good["hash"] = chain_hash(good["prev_hash"], canonical(1, 1.0, "revocation", None, None, None, {"grant": "g"}))
    assert marks.intact(EvidenceRecord.model_construct(**good))
    for bad in ({"hash": None}, {"hash": 5}, {"prev_hash": None}, {"prev_hash": b"0" * 64}, {"seq": "1"},
                {"ts": "not a time"}):
        assert not marks.intact(EvidenceRecord.model_construct(**{**good, **bad})), bad


def test_a_mark_not_signed_by_the_planes_key_is_not_used(signed):
    """Someone with the database appends a mark of their own (with its hash right): it names a digest of no
    authority records, so a plane starting from it would forget the revocations. It is not signed: not used; the
    plane starts from the newest signed mark behind it (a mark is no authority record: appended with its hash
    right, it breaks nothing)."""
    ledger, signer = signed
    forged = marks.Mark(through=31, through_hash="0" * 64, state_records=0,
                        state_digest=marks.StateDigest().hexdigest(), kinds=list(STATE_KINDS)).model_dump()
    with ledger.engine.begin() as conn:
        head = conn.execute(sa.select(chain_head.c.seq, chain_head.c.hash)).first()
        last = conn.execute(sa.select(evidence).where(evidence.c.seq == head.seq)).first()
        seq = head.seq + 1
        h = chain_hash(head.hash, canonical(seq, last.ts, marks.MARK_KIND, None, None, None, forged))
        conn.execute(sa.insert(evidence).values(seq=seq, ts=last.ts, kind=marks.MARK_KIND, flow_run_id=None,
                                                task_run_id=None, principal=None, payload=forged,
                                                prev_hash=head.hash, hash=h))
        conn.execute(sa.update(chain_head).where(chain_head.c.id == 1).values(seq=seq, hash=h))
    state = AuthorityState(ledger, trusted=[signer.public_key])
    state.refresh()
    assert state.marked_through == 30 and state.broken is None and _revoked(state) == {"g0", "g1", "g2"}


def test_a_record_of_another_kind_edited_before_the_mark_is_left_to_evidence_verify(signed):
    """What the start no longer reads: records that carry no authority (settlements here). An edit there changes no
    decision, and `aisched evidence verify` (Ledger.verify) still finds it."""
    ledger, signer = signed
    (row,) = [r for r in _rows(ledger, "settled") if r["payload"]["n"] == 3]
    with ledger.engine.begin() as conn:
        conn.execute(sa.update(evidence).where(evidence.c.seq == row["seq"]).values(payload={"n": 1000}))
    state = AuthorityState(ledger, trusted=[signer.public_key])
    state.refresh()
    assert state.broken is None and state.marked_through == 30 and _revoked(state) == {"g0", "g1", "g2"}
    report = ledger.verify()
    assert not report.ok and report.at_seq == row["seq"] and "edited" in report.problem
