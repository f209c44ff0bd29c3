"""A large result's one-time token is a capability: a neighbour that reads (or writes) the ledger gets none.

Before: the control plane filed each completed call's whole reply in the call book (`aisched_calls`), the one-time
token of a result kept on its worker included. A body that could read the ledger's database took B's token from
there, fetched B's result first, and B's flow got 404, then ResultLost. Now the call book keeps the result's digest,
size, URL and expiry in clear and the token only sealed (AES-256-GCM under a key derived from the plane's signing key
file, the call's key as associated data). Here A reads every row of the call book and tries every token-shaped
string in it on the worker's listener: all 404, and B still fetches its result. A that can also write the database
moves B's sealed token into its own call's row and asks for its call again: the seal does not open for A's call, and
A is told its result is lost, never given B's token.
"""

from __future__ import annotations

import os
import re
import uuid

import httpx
import pytest
import sqlalchemy as sa

from aisched_prefect import ai_task
from aisched_prefect.control.calls import calls
from aisched_prefect.flow.direct import fetch_result_sync
from tests.approval_helpers import RawCall
from tests.attacks.support import infer, tenant
from tests.helpers import send_raw

pytestmark = pytest.mark.usefixtures("prefect_api")

MiB = 2**20
TOKEN_SHAPED = re.compile(r"[A-Za-z0-9_-]{32,128}")


@ai_task(gpus=1, kind="inference", est_seconds=10)
def weights(size: int) -> bytes:
    return os.urandom(size)


def test_a_body_reading_the_call_book_gets_no_token_that_opens_another_runs_result(control_plane):
    a = tenant(control_plane, principal=f"team-a-{uuid.uuid4().hex[:6]}/nightly")
    b = tenant(control_plane, principal=f"team-b-{uuid.uuid4().hex[:6]}/etl")
    theirs, mine = RawCall(b, weights, 2 * MiB), RawCall(a, infer, 1)
    try:
        reply = send_raw(theirs)  # B's run completed; B's flow has not fetched yet
        assert reply.status == "completed" and reply.result_ref is not None
        ref = reply.result_ref
        # A reads the whole call book, as a body that reaches the ledger's database would.
        engine = control_plane.ledger().engine
        with engine.connect() as conn:
            book = [row for row in conn.execute(sa.select(calls)) if "result_ref" in str(row.reply)]
        assert any(ref.url in str(row.reply) and ref.digest in str(row.reply) for row in book)  # B's row is there
        candidates = {s for row in book for s in TOKEN_SHAPED.findall(str(tuple(row)))}
        assert ref.token not in candidates
        with httpx.Client(trust_env=False, timeout=10) as http:
            answers = {http.get(f"{ref.url}/results/{c}").status_code for c in candidates if len(c) <= 128}
        assert answers == {404}, answers
        # A can write the database too: it puts B's stored reply (its sealed token) in its own call's row and asks
        # for its call again. The seal opens only for the call it was made for.
        assert send_raw(mine).status == "completed"
        (b_row,) = [row for row in book if ref.digest in str(row.reply)]
        mine_key = next(k for k in _keys(engine) if mine.meta.task_run_id in k)
        with engine.begin() as conn:
            conn.execute(calls.update().where(calls.c.key == mine_key).values(reply=b_row.reply))
        stolen = send_raw(mine)
        assert stolen.status == "failed" and stolen.error_type == "aisched_prefect.ResultLost"
        assert stolen.result_ref is None and "does not open with this control plane's key" in stolen.error_message
        assert ref.token not in stolen.model_dump_json()
        # B's result is still B's.
        assert fetch_result_sync(ref, "weights") and httpx.get(f"{ref.url}/results/{ref.token}",
                                                               trust_env=False).status_code == 404
    finally:
        theirs.close()
        mine.close()


def _keys(engine) -> list[str]:
    with engine.connect() as conn:
        return [k for (k,) in conn.execute(sa.select(calls.c.key))]
