"""Attack 7, rewriting the record: whoever can write the database edits, deletes and appends evidence.

Before: anyone who could write the database appended records (a forged `approval-batch` made `approvals list`
show a 0.01 USD request while the signature approved a 16 USD run); signed checkpoints lived in the same database,
so once their rows were deleted a rewritten chain verified; grants, revocations and approver keys were outside the
chain, so deleting a revocation row re-authorized. Now authority is folded from the chain, any edit breaks the
hash chain, and checkpoints are published outside the database.

These tests tamper with a control plane of their own (its SQLite file), never the session's.
"""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from aisched_prefect import Ledger
from aisched_prefect.cli import app
from aisched_prefect.control.authority.identity import new_credential
from aisched_prefect.evidence import GENESIS, canonical, chain_hash
from aisched_prefect.ledger import chain_head, checkpoints, evidence
from blocks import ApprovalPolicyBlock, ApprovalRule
from tests.attacks.conftest import start_plane
from tests.attacks.support import (
    FlowThread, PRINCIPAL, authority, budget, infer, outcome, root, run_flow, runner_for, tenant, wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api")]  # a control plane started per test


@pytest.fixture
def published(tmp_path_factory) -> object:
    return tmp_path_factory.mktemp("published-checkpoints")


@pytest.fixture
def plane(prefect_api, gpu_cluster, dask_client, plane_home, tmp_path_factory, published):
    """A control plane of this test's own: each test tampers with its database, and a control plane that found its
    log tampered with admits nothing from then on (fail closed)."""
    p = start_plane(tmp_path_factory.mktemp("evidence"), plane_home, gpu_cluster.scheduler_address, published)
    yield p
    p.stop()


def cli_verify(plane, *args: str):
    """`aisched evidence verify` on the plane's ledger; with --checkpoint, pinned to the plane's key as printed."""
    pinned = ["--public-key", plane.info["public_key"]] if "--checkpoint" in args and "--public-key" not in args else []
    return CliRunner().invoke(app, ["evidence", "verify", "--ledger", plane.ledger_url, *args, *pinned])


def rows(engine) -> list:
    with engine.connect() as conn:
        return [r._mapping for r in conn.execute(sa.select(evidence).order_by(evidence.c.seq))]


def rechain(engine, edit=lambda row: row["payload"]) -> None:
    """Rewrite the whole chain as a careful forger would: `edit` each payload, recompute every hash and the head."""
    prev = GENESIS
    with engine.begin() as conn:
        for r in [dict(r) for r in conn.execute(sa.select(evidence).order_by(evidence.c.seq)).mappings()]:
            payload = edit(r)
            h = chain_hash(prev, canonical(r["seq"], r["ts"], r["kind"], r["flow_run_id"], r["task_run_id"],
                                           r["principal"], payload))
            conn.execute(sa.update(evidence).where(evidence.c.seq == r["seq"]).values(payload=payload, prev_hash=prev,
                                                                                      hash=h))
            prev, last = h, r["seq"]
        conn.execute(sa.update(chain_head).where(chain_head.c.id == 1).values(seq=last, hash=prev))


def append(engine, kind: str, payload: dict, *, honest_hash: bool, principal: str | None = None) -> int:
    """Append one record straight into the database, chained properly (anyone can compute sha256) or not."""
    with engine.begin() as conn:
        seq, head = conn.execute(sa.select(chain_head.c.seq, chain_head.c.hash)).one()
        ts = time.time()
        h = chain_hash(head, canonical(seq + 1, ts, kind, None, None, principal, payload)) if honest_hash else "f" * 64
        conn.execute(sa.insert(evidence).values(seq=seq + 1, ts=ts, kind=kind, flow_run_id=None, task_run_id=None,
                                                principal=principal, payload=payload, prev_hash=head, hash=h))
        conn.execute(sa.update(chain_head).where(chain_head.c.id == 1).values(seq=seq + 1, hash=h))
    return seq + 1


@pytest.fixture
def revoked(plane):
    """A tenant whose root ran once and was then revoked; the revocation's evidence row is then deleted."""
    grant = root()
    t = tenant(plane, grant)
    assert run_flow(t.runner(), lambda: outcome(infer, 1))[0] == 1
    plane.revoke(grant.id, reason="incident")
    ledger = Ledger(plane.ledger_url)
    (row,) = [dict(r) for r in rows(ledger.engine) if r["kind"] == "revocation" and r["payload"]["grant"] == grant.id]
    with ledger.engine.begin() as conn:
        conn.execute(sa.delete(evidence).where(evidence.c.seq == row["seq"]))
    yield t, grant, ledger


class TestARevocationRecordDeleted:
    """Someone deletes the revocation's row from the evidence table."""

    def test_deleting_a_revocation_record_is_detected_and_the_running_plane_still_denies(self, plane, revoked):
        t, grant, ledger = revoked
        out, _ = run_flow(t.runner(), lambda: outcome(infer, 2))
        assert out.startswith("denied: denied at authority") and f"grant {grant.id!r} is revoked" in out
        report = ledger.verify()
        assert not report.ok and "deleted or reordered" in report.problem
        result = cli_verify(plane)
        assert result.exit_code == 1 and "evidence chain broken" in result.stdout

    def test_a_replica_starting_on_that_database_does_not_reauthorize(self, plane, revoked, tmp_path):
        from aisched_prefect.control.authority.state import AuthorityState

        t, grant, ledger = revoked
        state = AuthorityState(Ledger(ledger.url))  # what every replica and restart folds first
        snap = state.refresh()
        # It stops at the gap, says why, and what it folded before the gap is all it has: it admits nothing.
        assert state.broken is not None and ("deleted, reordered or rewritten" in state.broken
                                             or "truncated" in state.broken), state.broken
        assert snap.seq < ledger.records()[-1].seq


def test_a_forged_record_appended_in_the_database_breaks_the_chain(plane):
    flow_token = tenant(plane, root()).token  # issued before the forgery
    ledger = Ledger(plane.ledger_url)
    seq = append(ledger.engine, "approval", {"approval": "nope", "approved": True, "approver": "alice"},
                 honest_hash=False)
    report = ledger.verify()
    assert not report.ok and report.at_seq == seq and "edited" in report.problem
    # The control plane folds it at its next admission, sees it does not follow, and admits nothing (fail closed).
    out, _ = run_flow(runner_for(plane, flow_token), lambda: outcome(infer, 1))
    assert out.startswith("denied: denied at configuration") and "evidence log is broken" in out, out


@pytest.mark.parametrize("honest_hash", [False, True], ids=["bad-hash", "rechained"])
def test_a_credential_appended_in_the_database_is_not_honored(plane, honest_hash):
    ledger = Ledger(plane.ledger_url)
    token, cred = new_credential(principal="mallory", tenant="operators", role="operator", created_by="bootstrap")
    append(ledger.engine, "credential-issued", {"credential": cred.model_dump(), "by": "bootstrap"},
           honest_hash=honest_hash, principal="bootstrap")
    assert plane.request("GET", "/v1/whoami", token=token).status_code == 401
    assert plane.request("POST", "/v1/credentials", token=token,
                         json={"principal": "mallory/flow", "role": "flow"}).status_code == 401
    # Rechained or not, the log is not the control plane's own any more: verify with its key says which record.
    report = ledger.verify(bytes.fromhex(plane.info["public_key"]), signed_records=True)
    assert not report.ok


def test_a_rewritten_chain_fails_against_the_published_checkpoint(plane, published):
    """A careful forger rewrites history below a checkpoint (a root grant's limit), recomputes every hash and the
    head, and deletes the checkpoints kept in the database: the chain verifies, the published checkpoint does not,
    and the control plane refuses to sign over the rewrite."""
    narrow = root(max_gpus=1)
    t = tenant(plane, narrow)
    cp = plane.ok("POST", "/v1/checkpoints")
    assert (published / "latest.json").exists() and cli_verify(plane, "--checkpoint", str(published)).exit_code == 0
    ledger = Ledger(plane.ledger_url)

    def widen(row):
        p = row["payload"]
        if row["kind"] == "config-applied" and (p["kind"], p["name"]) == ("authority", t.authority):
            p = {**p, "body": {**p["body"], "grants": [{**g, "max_gpus": 64} for g in p["body"]["grants"]]}}
        return p

    rechain(ledger.engine, widen)
    with ledger.engine.begin() as conn:
        conn.execute(sa.delete(checkpoints))
    assert ledger.verify().ok  # the chain alone cannot tell
    result = cli_verify(plane, "--checkpoint", str(published))
    # Caught twice over: the edited record no longer carries the control plane's signature, and the log no longer
    # holds the published checkpoint.
    assert result.exit_code == 1 and "not signed by the control plane's key" in result.stdout, result.stdout
    unsigned = CliRunner().invoke(app, ["evidence", "verify", "--ledger", plane.ledger_url, "--checkpoint",
                                        str(published), "--public-key", plane.info["public_key"]])
    assert unsigned.exit_code == 1
    from aisched_prefect.evidence import verify_published

    assert "history rewritten" in verify_published(ledger.records(), str(published),
                                                   bytes.fromhex(plane.info["public_key"])).problem
    # Nor will the control plane sign the rewritten log (its periodic chore would try within a minute), and a
    # flow's credential may not even ask it to.
    assert plane.request("POST", "/v1/checkpoints", token=t.token).status_code == 403
    refused = plane.request("POST", "/v1/checkpoints")
    assert refused.status_code == 400 and "no longer extends the last signed checkpoint" in refused.text
    assert cli_verify(plane, "--checkpoint", str(published)).exit_code == 1
    assert cp["seq"] >= 1
    (published / "latest.json").unlink()  # and with the published checkpoint deleted too
    assert "no published checkpoint" in verify_published(ledger.records(), str(published),
                                                         bytes.fromhex(plane.info["public_key"])).problem


def test_an_approval_set_in_the_database_executes_nothing(plane):
    from aisched_prefect.control.approvals.requests import approvals

    policy = ApprovalPolicyBlock(rules=[ApprovalRule(name="inference-needs-a-person", kinds=["inference"])],
                                 timeout_seconds=30)
    t = plane.tenant(authority(root()), budget(), policy, principal=PRINCIPAL)
    run = FlowThread(t.runner(), lambda: outcome(infer, 7))
    ledger = Ledger(plane.ledger_url)

    def pending():
        assert run.thread.is_alive(), run.error or run.result
        with ledger.engine.connect() as conn:
            return conn.execute(sa.select(approvals.c.id).where((approvals.c.principal == PRINCIPAL)
                                                                & (approvals.c.status == "pending"))).scalar()

    approval_id = wait_for(pending, 60, "the run to ask for approval")
    with ledger.engine.begin() as conn:
        conn.execute(sa.update(approvals).where(approvals.c.id == approval_id).values(
            status="approved", approved_by=["alice"], decided_by="alice"))
    out, _ = run.join(60)
    assert out != 7, "the run executed on an approval nobody gave"


def test_a_published_checkpoint_signed_by_another_key_is_refused(plane, published, tmp_path):
    """The forger also writes the published checkpoint, signed with a key of its own: verify checks the signature
    against the control plane's key (given as a PEM file here), never the key written inside the file."""
    import json

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    from aisched_prefect.evidence import checkpoint_body

    ledger = Ledger(plane.ledger_url)
    rechain(ledger.engine, lambda row: {**row["payload"], "forged": True} if row["seq"] == 1 else row["payload"])
    with ledger.engine.begin() as conn:
        conn.execute(sa.delete(checkpoints))
    seq, head = ledger.records()[-1].seq, ledger.records()[-1].hash
    mine = Ed25519PrivateKey.generate()
    (published / "latest.json").write_text(json.dumps({
        "seq": seq, "hash": head, "key_id": "mine", "ts": time.time(),
        "signature": mine.sign(checkpoint_body(seq, head)).hex(),
        "public_key": mine.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()}))
    pem = tmp_path / "control.pub"
    pem.write_bytes(Ed25519PublicKey.from_public_bytes(bytes.fromhex(plane.info["public_key"])).public_bytes(
        Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
    result = cli_verify(plane, "--checkpoint", str(published), "--public-key", str(pem))
    assert result.exit_code == 1, result.stdout
