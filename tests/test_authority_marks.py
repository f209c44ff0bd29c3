"""A control plane starts folding the evidence log at its newest authority mark (control.authority.marks), and only
where every authority record before the mark is as the mark says: start-up no longer grows with the log's history,
and an authority record deleted, edited or forged before the mark is still found."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from aisched_prefect import Ledger
from aisched_prefect.control.authority import marks
from aisched_prefect.control.authority.state import AuthorityState
from aisched_prefect.evidence import canonical, chain_hash
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
    edited and hashed again by someone without the plane's key: its signature no longer matches. Each time the mark
    is not used, the whole log is checked, and the fold stops where it broke."""
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
    assert state.marked_through == 0 and state.broken is not None
    assert _revoked(state) == {"g0"}  # the fold stopped at the change: nothing from there on counts


def test_a_mark_not_signed_by_the_planes_key_is_not_used(signed):
    """Someone with the database appends a mark of their own (with its hash right): it names a digest of no
    authority records, so a plane starting from it would forget the revocations. It is not signed: not used, and the
    whole log is checked (a mark is no authority record: appended with its hash right, it breaks nothing)."""
    ledger, signer = signed
    forged = marks.Mark(through=31, through_hash="0" * 64, state_records=0,
                        state_digest=marks.StateDigest().hexdigest()).model_dump()
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
    assert state.marked_through == 0 and state.broken is None and _revoked(state) == {"g0", "g1", "g2"}


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
