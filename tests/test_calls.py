"""The call book replicas share: who owns a call, and what a replica that failed or stalled leaves behind.

Units over a real ledger database (SQLite and Postgres), without a control plane: two CallBooks are two replicas.
"""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from aisched_prefect import Ledger
from aisched_prefect.control.calls import CallBook, CallTakenOver, calls
from aisched_prefect.ledger import BudgetLine

IDS = {"flow_run_id": "f", "task_run_id": "t", "principal": "team-a/x"}


def _line() -> BudgetLine:
    return BudgetLine(budget="team-a", period="2026-12", limit=10.0, amount=1.0)


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"  # the Postgres database is shared by every test and run


def _stall(book: CallBook) -> None:
    """The replica's heartbeat is older than its peers wait for: they take its calls over."""
    book.alive_seconds = 0.0


def test_a_stalled_replica_cannot_file_an_admission_for_a_call_another_took_over(ledger_url):
    """Replica a's heartbeat stalled while it admitted; b took the call over. a's holds roll back with its filing,
    so only one replica ever holds budget for the call."""
    ledger = Ledger(ledger_url)
    a, b = CallBook(ledger, _name("a"), "http://a"), CallBook(ledger, _name("b"), "http://b")
    key = _name("t")
    assert a.claim(key)[0] == "new"
    _stall(b)
    assert b.claim(key)[0] == "takeover"
    with pytest.raises(CallTakenOver, match="taken over by another replica"):
        ledger.reserve([_line()], kind="admission", payload={}, **IDS,
                       also=lambda conn, held, rec: a.admitted(key, {"id": str(rec.seq)}, conn))
    assert ledger.account("team-a", "2026-12") is None and ledger.records() == []  # nothing was ever held
    held, rec = ledger.reserve([_line()], kind="admission", payload={}, **IDS,
                               also=lambda conn, held, rec: b.admitted(key, {"id": str(rec.seq)}, conn))
    assert ledger.account("team-a", "2026-12")["pending"] == 1.0


def test_an_admitted_call_that_failed_on_its_replica_is_continued_not_admitted_again(ledger_url):
    """A failure after the holds were filed: the call is left for a takeover (by any replica, the same one included),
    which finds its admission; a call that failed before anything was decided is forgotten."""
    ledger = Ledger(ledger_url)
    a = CallBook(ledger, _name("a"), "http://a")
    bad, key = _name("t"), _name("t")
    assert a.claim(bad)[0] == "new"
    a.release(bad)  # bad input: nothing decided
    assert a.claim(bad)[0] == "new"
    assert a.claim(key)[0] == "new"
    a.admitted(key, {"id": "7"})
    a.release(key)
    claim, row = a.claim(key)
    assert claim == "takeover" and row.admission == {"id": "7"}
    with ledger.engine.connect() as conn:
        assert conn.execute(sa.select(calls.c.replica).where(calls.c.key == key)).scalar_one() == a.replica


def test_a_task_run_belongs_to_its_first_caller_and_keys_name_the_caller(ledger_url):
    """Task run ids are readable in Prefect: the first principal to call under one owns it (on every replica), and
    two callers' keys for the same task run and attempt never meet, so a stored reply goes back only to its caller."""
    from aisched_prefect.control.calls import call_key

    ledger = Ledger(ledger_url)
    a, b = CallBook(ledger, _name("a"), "http://a"), CallBook(ledger, _name("b"), "http://b")
    run = _name("tr")
    assert a.task_owner(run, "auth:team-b/etl") == "auth:team-b/etl"
    assert b.task_owner(run, "auth:team-a/nightly") == "auth:team-b/etl"  # another replica, from the database
    assert call_key("auth:team-a/nightly", run, 2) != call_key("auth:team-b/etl", run, 2)
    assert call_key("x:p", run, 1) == call_key("x:p", run, 1) != call_key("x:p", run, 1, "7")
    assert len(call_key("a" * 400, "t" * 64, 99, "9" * 20)) <= 300  # fits the key column, whatever the names


def test_a_call_under_another_principals_task_run_is_refused_and_claims_nothing(ledger_url):
    """`check_and_claim` files a new task run's owner and claims its call in one write: a call under a task run
    another principal called under first is refused (on any replica) and leaves no call row; the owner's goes on."""
    from aisched_prefect.control.calls import Unauthorized, call_key

    ledger = Ledger(ledger_url)
    a, b = CallBook(ledger, _name("a"), "http://a"), CallBook(ledger, _name("b"), "http://b")
    flow, run = _name("fr"), _name("tr")
    owner, thief = "auth:team-b/etl", "auth:team-a/nightly"
    assert a.check_and_claim(flow, run, owner, call_key(owner, run, 1))[0] == "new"
    b.owner(flow, owner)
    stolen = call_key(thief, run, 1)
    with pytest.raises(Unauthorized, match="belongs to another principal"):
        b.check_and_claim(_name("fr"), run, thief, stolen)  # its own flow run, another's task run
    assert b.get(stolen) is None
    with pytest.raises(Unauthorized, match="belongs to another principal"):
        b.check_and_claim(_name("fr"), run, thief, stolen)  # known now: refused from the cache too
    assert b.check_and_claim(flow, run, owner, call_key(owner, run, 2))[0] == "new"
    assert b.check_and_claim(flow, run, owner, call_key(owner, run, 1))[0] == "busy"  # a's, alive


def _completed(token: str) -> dict:
    ref = {"url": "http://10.0.0.5:4321", "token": token, "digest": "ab" * 32, "size": 3 * 2**20, "expires_at": 1e10}
    return {"status": "completed", "key": "", "result_digest": "ab" * 32, "result_ref": ref}


def _rows_text(ledger: Ledger) -> str:
    with ledger.engine.connect() as conn:
        return "\n".join(str(tuple(row)) for row in conn.execute(sa.select(calls)))


def test_a_completed_calls_result_token_is_kept_sealed_and_opens_only_for_its_call_under_the_planes_key(ledger_url):
    """The call book keeps a large result's digest, size, URL and expiry in clear and its one-time token sealed
    (AES-GCM under a key derived from the plane's signing key, the call's key as associated data): the database alone
    gives no token; the plane's key opens it for that call only; a plane with another key, or none, says why not."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from aisched_prefect.control.calls import TOKEN_PURPOSE, TokenSeal
    from aisched_prefect.control.authority.keys import derived_secret

    ledger = Ledger(ledger_url)
    key_file = Ed25519PrivateKey.generate()
    seal = TokenSeal(derived_secret(key_file, TOKEN_PURPOSE))
    a = CallBook(ledger, _name("a"), "http://a", seal=seal)
    token, key, other = "T" * 43, _name("t"), _name("t")
    for k in (key, other):
        assert a.claim(k)[0] == "new"
        a.admitted(k, {"id": "1"})
    a.done(key, _completed(token))
    text = _rows_text(ledger)
    assert token not in text and "ab" * 32 in text and "http://10.0.0.5:4321" in text
    row = a.get(key)
    assert "token" not in row.reply["result_ref"] and row.reply["result_ref"]["sealed_token"].startswith("aesgcm1:")
    # Another replica with the same key file opens it: a flow re-attaching there gets its reference back.
    b = CallBook(ledger, _name("b"), "http://b", seal=TokenSeal(derived_secret(key_file, TOKEN_PURPOSE)))
    opened, why = b.reply(key, b.get(key).reply)
    assert why == "" and opened["result_ref"]["token"] == token and opened["result_ref"]["size"] == 3 * 2**20
    # Moved into another call's row (someone who can write the database), it does not open for that call.
    with ledger.engine.begin() as conn:
        conn.execute(calls.update().where(calls.c.key == other).values(status="done", reply=row.reply))
    moved, why = b.reply(other, b.get(other).reply)
    assert "result_ref" not in moved and "does not open with this control plane's key" in why
    # Another plane's key, or none: no token, and the reason is named.
    stranger = TokenSeal(derived_secret(Ed25519PrivateKey.generate(), TOKEN_PURPOSE))
    assert "does not open" in CallBook(ledger, _name("c"), "http://c", seal=stranger).reply(key, row.reply)[1]
    assert "no key to open" in CallBook(ledger, _name("d"), "http://d").reply(key, row.reply)[1]
    # A book without a seal keeps no token at all.
    plain, k2 = CallBook(ledger, _name("e"), "http://e"), _name("t")
    plain.claim(k2)
    plain.done(k2, _completed(token))
    assert token not in _rows_text(ledger) and "keeps no token" in plain.reply(k2, plain.get(k2).reply)[1]


def test_tokens_an_older_plane_wrote_in_clear_are_sealed_when_a_plane_starts(ledger_url):
    from aisched_prefect.control.calls import TokenSeal

    ledger = Ledger(ledger_url)
    old = CallBook(ledger, _name("old"), "http://old")
    key = _name("t")
    old.claim(key)
    with ledger.engine.begin() as conn:  # as a plane before the seal filed it
        conn.execute(calls.update().where(calls.c.key == key).values(status="done", reply=_completed("C" * 43)))
    assert "C" * 43 in _rows_text(ledger)
    seal = TokenSeal(bytes(range(32)))
    new = CallBook(ledger, _name("new"), "http://new", seal=seal)
    assert "C" * 43 not in _rows_text(ledger)
    assert new.reply(key, new.get(key).reply)[0]["result_ref"]["token"] == "C" * 43


def test_a_small_results_bytes_are_kept_sealed_with_its_reply_for_a_plane_that_restarted(ledger_url):
    """A run that ended just before its plane died: its inline result was only in that plane's memory. The call book
    keeps bytes up to KEEP_RESULT_BYTES sealed beside the reply (the database alone does not show them), so the plane
    that comes back hands them to the flow that sends the call again, instead of a ResultLost for a finished run."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from aisched_prefect.control.calls import KEEP_RESULT_BYTES, TOKEN_PURPOSE, TokenSeal
    from aisched_prefect.control.authority.keys import derived_secret

    ledger = Ledger(ledger_url)
    key_file = Ed25519PrivateKey.generate()
    before = CallBook(ledger, _name("before"), "http://a", seal=TokenSeal(derived_secret(key_file, TOKEN_PURPOSE)))
    small, large, plain = _name("t"), _name("t"), _name("t")
    secret = b"the-result-" + uuid.uuid4().hex.encode()
    for k, out in ((small, secret), (large, b"x" * (KEEP_RESULT_BYTES + 1))):
        before.claim(k)
        before.done(k, {"status": "completed", "key": k}, out)
    assert secret.decode() not in _rows_text(ledger)
    after = CallBook(ledger, _name("after"), "http://a", seal=TokenSeal(derived_secret(key_file, TOKEN_PURPOSE)))
    row = after.get(small)
    assert after.out(small, row.reply) == secret
    assert "sealed_out" not in after.reply(small, row.reply)[0]
    assert after.out(large, after.get(large).reply) is None  # past the bound: not kept
    before.claim(plain)
    with ledger.engine.begin() as conn:  # moved into another call's row, it does not open for that call
        conn.execute(calls.update().where(calls.c.key == plain).values(status="done", reply=row.reply))
    assert after.out(plain, after.get(plain).reply) is None
    assert CallBook(ledger, _name("other"), "http://a").out(small, row.reply) is None  # no key: nothing opens
