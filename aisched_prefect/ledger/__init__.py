"""The ledger: budget holds, versioned limits and the evidence log, in one SQL database (SQLite or Postgres).

One concern per module:

- `schema`: the tables, the schema version, the migrations
- `engine`: the URL, the engines, the database's clock, which failures to retry
- `statements`: the write path's SQL, compiled once per dialect
- `amounts`: checking amounts, micro-units, rounding carries that never drift
- `limits`: limits, units and windows from the applied configuration, versioned
- `budget`: reserve, settle, renew and expire, a reservation's holds always together
- `alerts`: threshold alerts
- `batch`: one write transaction's working set
- `commit`: group commit, each write isolated, deadlocks retried
- `evidence_log`: the hash chain: append, read, verify, sign
- `authority`: delegated grants, revocations, flow versions
- `queries`: what reports and the CLI read
- `api`: the `Ledger` that ties them together
"""

from aisched_prefect.errors import InvalidAmount, InvalidLedgerInput, LedgerUnavailable
from aisched_prefect.ledger.alerts import ALERT_REARM_POINTS, ALERT_THRESHOLDS
from aisched_prefect.ledger.amounts import FEMTOS, MAX_LEASE_SECONDS, MICROS, from_micros, to_micros
from aisched_prefect.ledger.api import DEFAULT_LEASE_SECONDS, Ledger
from aisched_prefect.ledger.engine import HOME_ENV, LEDGER_URL_ENV, default_url, make_engine
from aisched_prefect.ledger.limits import rolling_seconds
from aisched_prefect.ledger.records import BudgetAlert, BudgetExceeded, Hold, LimitsApplied, Settlement
from aisched_prefect.ledger.schema import (
    MIGRATIONS,
    SCHEMA_VERSION,
    accounts,
    budget_limits,
    chain_head,
    checkpoints,
    evidence,
    flow_versions,
    grants,
    holds,
    metadata,
    revocations,
    schema_version,
)
from blocks import BudgetLine

__all__ = [
    "ALERT_REARM_POINTS",
    "ALERT_THRESHOLDS",
    "BudgetAlert",
    "BudgetExceeded",
    "BudgetLine",
    "DEFAULT_LEASE_SECONDS",
    "FEMTOS",
    "HOME_ENV",
    "Hold",
    "InvalidAmount",
    "InvalidLedgerInput",
    "LEDGER_URL_ENV",
    "Ledger",
    "LedgerUnavailable",
    "LimitsApplied",
    "MAX_LEASE_SECONDS",
    "MICROS",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "Settlement",
    "accounts",
    "budget_limits",
    "chain_head",
    "checkpoints",
    "default_url",
    "evidence",
    "flow_versions",
    "from_micros",
    "grants",
    "holds",
    "make_engine",
    "metadata",
    "revocations",
    "rolling_seconds",
    "schema_version",
    "to_micros",
]
