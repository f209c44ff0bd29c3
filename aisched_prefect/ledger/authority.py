"""Authority kept in the ledger: delegated grants, revocations, and the flow versions already admitted."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from aisched_prefect.evidence import EvidenceRecord
from blocks import Grant
from aisched_prefect.ledger.schema import flow_versions, grants, revocations


def add_grant_op(grant: Grant, by: str) -> Any:
    """A write that stores a delegated grant (already checked against its parent) and records the delegation."""
    if grant.parent is None:
        raise ValueError(f"grant {grant.id!r} has no parent: root grants live in the AuthorityBlock")

    def op(w: Any) -> EvidenceRecord:
        if w.conn.execute(sa.select(grants.c.id).where(grants.c.id == grant.id)).first() is not None:
            raise LookupError(f"a grant {grant.id!r} already exists: choose another id")
        w.conn.execute(grants.insert().values(
            id=grant.id, parent=grant.parent, principal=grant.principal,
            body=grant.model_dump(mode="json"), created_at=w.now, created_by=by))
        return w.append("delegation", {"grant": grant.model_dump(mode="json"), "by": by},
                        {"flow_run_id": None, "task_run_id": None, "principal": by})

    return op


def revoke_op(grant_id: str, by: str, reason: str) -> Any:
    """A write that revokes a grant (root or delegated), and so everything delegated from it; once."""

    def op(w: Any) -> EvidenceRecord | None:
        if w.conn.execute(sa.select(revocations.c.grant_id).where(revocations.c.grant_id == grant_id)).first():
            return None
        w.conn.execute(revocations.insert().values(grant_id=grant_id, revoked_at=w.now, revoked_by=by, reason=reason))
        return w.append("revocation", {"grant": grant_id, "by": by, "reason": reason},
                        {"flow_run_id": None, "task_run_id": None, "principal": by})

    return op


def mark_flow_version_op(flow: str, version: str) -> Any:
    """A write that remembers a run of this flow version was admitted (once; later ones change nothing)."""

    def op(w: Any) -> None:
        if w.conn.execute(sa.select(flow_versions.c.flow).where(
                (flow_versions.c.flow == flow) & (flow_versions.c.version == version))).first() is None:
            w.conn.execute(flow_versions.insert().values(flow=flow, version=version, first_admitted_at=w.now))

    return op


def delegated_grants(reader: Engine) -> dict[str, Grant]:
    with reader.connect() as conn:
        return {row.id: Grant.model_validate(row.body) for row in conn.execute(sa.select(grants.c.id, grants.c.body))}


def flow_version_seen(reader: Engine, flow: str, version: str) -> bool:
    """Whether a run of this flow at this version was ever admitted."""
    with reader.connect() as conn:
        return conn.execute(sa.select(flow_versions.c.flow).where(
            (flow_versions.c.flow == flow) & (flow_versions.c.version == version))).first() is not None


def revoked_ids(reader: Engine, sql: str) -> set[str]:
    """Every revoked grant id. Read at each admission, so on the raw cursor: one statement, no ORM-side work."""
    conn = reader.raw_connection()
    try:
        cur = conn.cursor()
        cur.execute(sql)
        ids = {row[0] for row in cur.fetchall()}
        cur.close()
        conn.commit()  # end the read (a snapshot on Postgres) before the connection goes back to the pool
        return ids
    finally:
        conn.close()
