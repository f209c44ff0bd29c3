"""The ledger's tables, its schema version, and the migrations that bring an older ledger up to it."""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from aisched_prefect.evidence import GENESIS

# 2: delegated grants and revocations; 3: signed checkpoints; 4: units, leases, alerts; 5: flow versions;
# 6: hold groups, rounding carries, versioned limits; 7: indexes; 8: warm bodies
SCHEMA_VERSION = 9

metadata = sa.MetaData()

schema_version = sa.Table("aisched_schema", metadata, sa.Column("version", sa.Integer, nullable=False))

accounts = sa.Table(
    "aisched_budget_accounts", metadata,
    sa.Column("budget", sa.String(200), primary_key=True),
    sa.Column("period", sa.String(32), primary_key=True),
    sa.Column("limit_micros", sa.BigInteger, nullable=False),
    sa.Column("pending_micros", sa.BigInteger, nullable=False, default=0),
    sa.Column("posted_micros", sa.BigInteger, nullable=False, default=0),
    sa.Column("unit", sa.String(16), nullable=False, server_default="money"),
    sa.Column("alerted", sa.Integer, nullable=False, server_default="0"),
    # posted minus the true sum of the charges, in femto-units (1e-15), always within one micro-unit
    sa.Column("carry_femtos", sa.BigInteger, nullable=False, server_default="0"),
)

holds = sa.Table(
    "aisched_holds", metadata,
    sa.Column("id", sa.String(36), primary_key=True),
    sa.Column("budget", sa.String(200), nullable=False),
    sa.Column("period", sa.String(32), nullable=False),
    sa.Column("flow_run_id", sa.String(64)),
    sa.Column("task_run_id", sa.String(64), index=True),
    sa.Column("principal", sa.String(200)),
    sa.Column("reserved_micros", sa.BigInteger, nullable=False),
    sa.Column("charged_micros", sa.BigInteger),
    sa.Column("status", sa.String(16), nullable=False),  # pending | posted | voided | expired
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("settled_at", sa.Float),
    sa.Column("unit", sa.String(16), nullable=False, server_default="money"),
    sa.Column("lease_until", sa.Float),
    # the reservation the hold belongs to: its holds are renewed, expired and settled together
    sa.Column("group_id", sa.String(36), index=True),
    # the evidence record of that reservation: orders a run's holds on one account (top-ups after the first)
    sa.Column("reserved_seq", sa.BigInteger),
    sa.Index("ix_aisched_holds_account", "budget", "period", "status"),
    sa.Index("ix_aisched_holds_lease", "status", "lease_until"),
    sa.Index("ix_aisched_holds_flow_run", "flow_run_id"),  # a flow run's end reads its own holds, not the day's
)

# The applied budget configuration, one row per budget: its limit comes from the newest version applied.
budget_limits = sa.Table(
    "aisched_budget_limits", metadata,
    sa.Column("budget", sa.String(200), primary_key=True),
    sa.Column("limit_micros", sa.BigInteger, nullable=False),
    sa.Column("unit", sa.String(16), nullable=False),
    sa.Column("rolling_seconds", sa.Float),
    sa.Column("version", sa.BigInteger, nullable=False),
    sa.Column("applied_at", sa.Float, nullable=False),
)

evidence = sa.Table(
    "aisched_evidence", metadata,
    sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("ts", sa.Float, nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("flow_run_id", sa.String(64), index=True),
    sa.Column("task_run_id", sa.String(64), index=True),
    sa.Column("principal", sa.String(200)),
    sa.Column("payload", sa.JSON, nullable=False),
    sa.Column("prev_hash", sa.String(64), nullable=False),
    sa.Column("hash", sa.String(64), nullable=False),
    sa.Index("ix_aisched_evidence_kind_seq", "kind", "seq"),  # authority records, and reports, by kind
)

grants = sa.Table(
    "aisched_grants", metadata,
    sa.Column("id", sa.String(200), primary_key=True),
    sa.Column("parent", sa.String(200), nullable=False),
    sa.Column("principal", sa.String(200), nullable=False),
    sa.Column("body", sa.JSON, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("created_by", sa.String(200), nullable=False),
)

revocations = sa.Table(
    "aisched_revocations", metadata,
    sa.Column("grant_id", sa.String(200), primary_key=True),
    sa.Column("revoked_at", sa.Float, nullable=False),
    sa.Column("revoked_by", sa.String(200), nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
)

checkpoints = sa.Table(
    "aisched_checkpoints", metadata,
    sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("hash", sa.String(64), nullable=False),
    sa.Column("key_id", sa.String(64), nullable=False),
    sa.Column("signature", sa.String(128), nullable=False),
    sa.Column("ts", sa.Float, nullable=False),
)

flow_versions = sa.Table(
    "aisched_flow_versions", metadata,
    sa.Column("flow", sa.String(200), primary_key=True),
    sa.Column("version", sa.String(200), primary_key=True),
    sa.Column("first_admitted_at", sa.Float, nullable=False),
)

# A warm body's life as the control plane keeps it (control/dispatch/warm_rows.py): started cold by a run, idle with its hold,
# taken by the next run of its key, ended and why. Any replica, or a plane started again, reads the idle ones here.
warm_bodies = sa.Table(
    "aisched_warm_bodies", metadata,
    sa.Column("body", sa.String(64), primary_key=True),
    sa.Column("key", sa.String(64), nullable=False),
    sa.Column("tenant", sa.String(200), nullable=False),
    sa.Column("principal", sa.String(200), nullable=False),
    sa.Column("worker", sa.String(300), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),  # idle | running | ended
    sa.Column("runs", sa.Integer, nullable=False),  # runs it has served; while idle, names its idle period
    sa.Column("admission", sa.JSON),  # the run that left it idle: its principal, budget lines and authority
    sa.Column("holds", sa.JSON),  # the hold of its idle period
    sa.Column("keep_seconds", sa.Float, nullable=False, server_default="0"),
    sa.Column("gpu_type", sa.String(64)),
    sa.Column("started_at", sa.Float, nullable=False),  # its cold start
    sa.Column("idle_since", sa.Float),  # when its idle period began (the plane's clock); carried on: its last wait
    sa.Column("idle_before", sa.Float, nullable=False, server_default="0"),  # carried on: the earlier waits' seconds
    sa.Column("waits", sa.JSON),  # carried on: each earlier wait, [admission of the run that ended it, seconds]
    sa.Column("taken_at", sa.Float),  # when a run of its key last took it
    sa.Column("ended_at", sa.Float),
    sa.Column("ended_why", sa.Text),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Index("ix_aisched_warm_bodies_state", "state"),
)

chain_head = sa.Table(
    "aisched_chain_head", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("hash", sa.String(64), nullable=False),
)


def _group_pending_holds(conn: Connection) -> None:
    """A schema-5 ledger kept no groups: each hold is its own, except that the pending holds of one
    reservation (one task run, one instant) become one group, so they expire and settle together."""
    conn.exec_driver_sql("UPDATE aisched_holds SET group_id = id WHERE group_id IS NULL")
    rows = conn.execute(sa.select(holds.c.id, holds.c.task_run_id, holds.c.created_at)
                        .where((holds.c.status == "pending") & holds.c.task_run_id.is_not(None))
                        .order_by(holds.c.id)).all()
    groups: dict[tuple[str, float], list[str]] = {}
    for hold_id, task_run_id, created_at in rows:
        groups.setdefault((task_run_id, created_at), []).append(hold_id)
    for ids in groups.values():
        if len(ids) > 1:
            conn.execute(holds.update().where(holds.c.id.in_(ids)).values(group_id=ids[0]))


def _index(conn: Connection, name: str, table: str, columns: str) -> None:
    """An index on a table the ledger has (a table it lacks is created later, with its indexes)."""
    if sa.inspect(conn).has_table(table):
        conn.exec_driver_sql(f"CREATE INDEX IF NOT EXISTS {name} ON {table} ({columns})")


def _column(conn: Connection, table: str, column: str, ddl: str) -> None:
    """A column added to a table the ledger has (a table it lacks is created later, with its columns)."""
    inspector = sa.inspect(conn)
    if inspector.has_table(table) and column not in {c["name"] for c in inspector.get_columns(table)}:
        conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {column} {ddl}")


# What turns a ledger of version N-1 into version N (new tables are created by `create_all`;
# these are the changes to existing ones). Each runs once, in order.
MIGRATIONS: dict[int, list[str | Callable[[Connection], None]]] = {
    2: [],
    3: [],
    4: [
        "ALTER TABLE aisched_budget_accounts ADD COLUMN unit VARCHAR(16) NOT NULL DEFAULT 'money'",
        "ALTER TABLE aisched_budget_accounts ADD COLUMN alerted INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE aisched_holds ADD COLUMN unit VARCHAR(16) NOT NULL DEFAULT 'money'",
        "ALTER TABLE aisched_holds ADD COLUMN lease_until FLOAT",
        "CREATE INDEX IF NOT EXISTS ix_aisched_holds_account ON aisched_holds (budget, period, status)",
        "CREATE INDEX IF NOT EXISTS ix_aisched_holds_task_run_id ON aisched_holds (task_run_id)",
    ],
    5: [],  # aisched_flow_versions is a new table
    6: [  # aisched_budget_limits is a new table
        "ALTER TABLE aisched_budget_accounts ADD COLUMN carry_femtos BIGINT NOT NULL DEFAULT 0",
        "ALTER TABLE aisched_holds ADD COLUMN group_id VARCHAR(36)",
        "ALTER TABLE aisched_holds ADD COLUMN reserved_seq BIGINT",
        _group_pending_holds,
        "CREATE INDEX IF NOT EXISTS ix_aisched_holds_group_id ON aisched_holds (group_id)",
        "CREATE INDEX IF NOT EXISTS ix_aisched_holds_lease ON aisched_holds (status, lease_until)",
    ],
    7: [  # what grows with history must not be scanned per flow run or per refresh of the authority state
        lambda conn: _index(conn, "ix_aisched_holds_flow_run", "aisched_holds", "flow_run_id"),
        lambda conn: _index(conn, "ix_aisched_evidence_kind_seq", "aisched_evidence", "kind, seq"),
    ],
    8: [],  # aisched_warm_bodies is a new table
    9: [  # a warm body's idle period carried on by back-to-back runs (control/dispatch/warm.py `_carry`)
        lambda conn: _column(conn, "aisched_warm_bodies", "idle_before", "FLOAT NOT NULL DEFAULT 0"),
        lambda conn: _column(conn, "aisched_warm_bodies", "waits", "JSON"),
    ],
}


class SchemaTooNew(RuntimeError):
    """The ledger was written by a newer aisched-prefect than this one."""


def migrate(engine: Engine, url: str) -> None:
    """Create a fresh ledger, or bring an older one up to SCHEMA_VERSION in place (once, whoever comes first)."""
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":  # two processes opening a fresh ledger: one creates, the other waits
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(7324180041)"))
        if not sa.inspect(conn).has_table(schema_version.name):
            metadata.create_all(conn)
            conn.execute(schema_version.insert().values(version=SCHEMA_VERSION))
            conn.execute(chain_head.insert().values(id=1, seq=0, hash=GENESIS))
            return
        version = conn.execute(sa.select(schema_version.c.version)).scalar() or 0
        if version > SCHEMA_VERSION:
            raise SchemaTooNew(f"ledger {url} has schema version {version}, newer than this aisched-prefect "
                               f"({SCHEMA_VERSION}). Fix: upgrade aisched-prefect")
        if version == SCHEMA_VERSION:
            return
        for target in range(version + 1, SCHEMA_VERSION + 1):
            for step in MIGRATIONS[target]:
                if isinstance(step, str):
                    conn.exec_driver_sql(step)
                else:
                    step(conn)
        metadata.create_all(conn, checkfirst=True)  # tables added since `version`
        conn.execute(schema_version.update().values(version=SCHEMA_VERSION))
