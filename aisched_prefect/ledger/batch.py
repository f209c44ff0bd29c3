"""One write transaction's working set: the accounts, holds and evidence it touches, flushed in a few statements.

Operations (reserve, settle, ...) read and change the books through this
object; nothing reaches the database before `flush`, except the rare
statements an operation runs on `conn` itself. Every transaction first locks
the chain head and reads the database's clock with it (`now`): leases,
settlement times, rolling windows and evidence timestamps all come from that
one clock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import Connection

from aisched_prefect.evidence import EvidenceRecord
from aisched_prefect.ledger.alerts import crossed
from aisched_prefect.ledger.amounts import FEMTOS, post_amount
from aisched_prefect.ledger.evidence_log import check_ids, next_record, payload_json
from aisched_prefect.ledger.records import BudgetAlert
from aisched_prefect.ledger.limits import Config, rolling_seconds
from aisched_prefect.ledger.statements import (
    EVIDENCE_COLUMNS,
    EVIDENCE_VALUES,
    HOLD_COLUMNS,
    HOLD_VALUES,
    Statements,
)

NO_IDS = {"flow_run_id": None, "task_run_id": None, "principal": None}


class Account:
    """One budget account as the current transaction sees it (micro-units; carry in femto-units)."""

    __slots__ = ("budget", "period", "unit", "limit", "pending", "posted", "alerted", "carry", "rolling", "dirty", "new",
                 "kept")

    def __init__(self, budget: str, period: str, row: tuple[Any, ...], new: bool = False) -> None:
        self.budget, self.period = budget, period
        self.limit, self.pending, self.posted, self.alerted, self.unit, self.carry = row
        self.rolling: float | None = None
        self.dirty = False
        self.new = new  # not in the database yet: inserted at flush only if a write that succeeded kept it
        self.kept = not new

    @property
    def free(self) -> int:
        return self.limit - self.pending - self.posted


class WriteBatch:
    """The books as one transaction changes them. `conn` is the transaction's SQLAlchemy connection."""

    def __init__(self, conn: Connection, sql: Statements, signer: Callable[[bytes], str] | None = None) -> None:
        self.conn, self.sql, self.signer = conn, sql, signer
        self.cur = conn.connection.cursor()
        seq, head, now = sql.head.run(self.cur).fetchone()
        self.head: tuple[int, str] = (seq, head)
        self.now = float(now)
        self.accounts: dict[tuple[str, str], Account] = {}
        self.configs: dict[str, Config | None] = {}
        self.config_changes: dict[str, Config] = {}
        self._configs_stored: set[str] = set()
        self.holds: dict[str, dict[str, Any]] = {}
        self.groups: dict[str, list[str]] = {}
        self.new_holds: set[str] = set()
        self.dirty_holds: set[str] = set()
        self.evidence: list[dict[str, Any]] = []
        self._payload_texts: list[str] = []  # each record's payload as stored (checked JSON), in order
        self.alerts: list[BudgetAlert] = []

    @property
    def _head(self) -> tuple[int, str]:  # the name before schema 6
        return self.head

    # -- accounts and their configuration ----------------------------------------------
    def config(self, budget: str) -> Config | None:
        """The budget's applied configuration, if any version was applied."""
        if budget not in self.configs:
            row = self.sql.limit.run(self.cur, k_budget=budget).fetchone()
            self._remember_config(budget, row)
        return self.configs[budget]

    def _remember_config(self, budget: str, row: tuple[Any, ...] | None) -> None:
        if row is None or row[3] is None:
            self.configs[budget] = None
        else:
            self.configs[budget] = Config(int(row[0]), row[1], row[2], int(row[3]))
            self._configs_stored.add(budget)

    def set_config(self, budget: str, cfg: Config) -> None:
        """Apply a newer configuration of `budget`: to every account of it, loaded here or not (at flush)."""
        self.configs[budget] = cfg
        self.config_changes[budget] = cfg
        for acct in self.accounts.values():
            if acct.budget == budget and (acct.limit, acct.unit) != (cfg.limit, cfg.unit):
                acct.limit, acct.unit, acct.dirty = cfg.limit, cfg.unit, True

    def account(self, budget: str, period: str, create: tuple[int, str] | None = None) -> Account:
        """The account (budget, period); `create` = (limit, unit) makes it if it does not exist yet."""
        key = (budget, period)
        acct = self.accounts.get(key)
        if acct is not None:
            return acct
        row = self.sql.account.run(self.cur, k_budget=budget, k_period=period).fetchone()
        if row is None:
            if create is None:
                raise LookupError(f"no budget account {budget!r} ({period}) in the ledger")
            # Not inserted yet: a reservation refused for want of room must leave no account behind (`keep`).
            acct = Account(budget, period, (create[0], 0, 0, 0, create[1], 0), new=True)
            self.config(budget)
        else:
            acct = Account(budget, period, row[:6])  # limit, pending, posted, alerted, unit, carry
            if budget not in self.configs:
                self._remember_config(budget, row[6:])
        self.accounts[key] = acct
        cfg = self.configs[budget]
        self.set_window(acct, (cfg.rolling if cfg is not None else None) or rolling_seconds(period))
        if cfg is not None and (acct.limit, acct.unit) != (cfg.limit, cfg.unit):
            acct.limit, acct.unit, acct.dirty = cfg.limit, cfg.unit, True
        return acct

    def keep(self, acct: Account) -> None:
        """The account is part of a write that succeeds: a new one is inserted at flush."""
        acct.kept = True

    def set_window(self, acct: Account, rolling: float | None) -> None:
        """Count only what was charged inside the account's rolling window (by the database's clock), if it has one.

        Decided once per transaction, before the account changes: a window set later applies from the next one.
        """
        if rolling is None or acct.rolling is not None or acct.dirty:
            return
        acct.rolling = rolling
        acct.posted = int(self.sql.rolling_posted.run(self.cur, k_budget=acct.budget, k_period=acct.period,
                                                      k_since=self.now - rolling).fetchone()[0])
        acct.dirty = True

    # -- holds ---------------------------------------------------------------------------
    def groups_of(self, hold_ids: list[str], missing_ok: bool = False) -> list[str]:
        """The groups (reservations) these holds belong to, each loaded whole; in first-seen order."""
        out: list[str] = []
        for hold_id in hold_ids:
            h = self.holds.get(hold_id)
            if h is None:
                rows = self.sql.group_of.run(self.cur, k_id=hold_id).fetchall()
                if not rows:
                    if missing_ok:
                        continue
                    raise LookupError(f"no hold {hold_id!r} in the ledger")
                for row in rows:
                    d = dict(zip(HOLD_COLUMNS, row))
                    if d["id"] not in self.holds:
                        self.holds[d["id"]] = d
                        self.groups.setdefault(d["group_id"], []).append(d["id"])
                h = self.holds[hold_id]
            if h["group_id"] not in out:
                out.append(h["group_id"])
        return out

    def group(self, group_id: str) -> list[dict[str, Any]]:
        """Every hold of one reservation, by account."""
        if group_id not in self.groups:
            rows = self.sql.group.run(self.cur, k_group=group_id).fetchall()
            self.groups[group_id] = []
            for row in rows:
                d = dict(zip(HOLD_COLUMNS, row))
                self.holds.setdefault(d["id"], d)
                self.groups[group_id].append(d["id"])
        return sorted((self.holds[i] for i in self.groups[group_id]), key=lambda h: (h["budget"], h["period"], h["id"]))

    def add_hold(self, h: dict[str, Any]) -> None:
        self.holds[h["id"]] = h
        self.groups.setdefault(h["group_id"], []).append(h["id"])
        self.new_holds.add(h["id"])

    def touch(self, h: dict[str, Any]) -> None:
        self.dirty_holds.add(h["id"])

    def post(self, hs: list[dict[str, Any]], charge: int, status: str) -> int:
        """Charge each hold `charge` femto-units: one micro-unit amount for all, so nested accounts stay equal.

        The holds are pending, of one reservation, each on its own account,
        all of one size. A charge within the hold posts in full while the
        limits are those it was taken under (the hold was the promise); above
        it, only what every account still has room for. Posted never passes a
        limit the books show: where an operator cut a limit below what was
        held, a charge posts only what that limit has left, and the rest is
        written off (uncovered, in the evidence). Returns the part of `charge` posted.
        """
        accts = [self.accounts[(h["budget"], h["period"])] for h in hs]
        reserved = hs[0]["reserved_micros"]
        cap = min(min(reserved + max(a.free, 0), max(a.limit - a.posted, 0)) for a in accts)
        posted, covered = post_amount(charge, [a.carry for a in accts], cap)
        for h, a in zip(hs, accts):
            a.pending -= h["reserved_micros"]
            a.posted += posted
            a.carry += posted * FEMTOS - covered
            a.dirty = True
            h.update(status=status, charged_micros=posted, settled_at=self.now)
            self.touch(h)
        return covered

    def void(self, h: dict[str, Any]) -> None:
        """Release a pending hold, charging nothing."""
        a = self.accounts[(h["budget"], h["period"])]
        a.pending -= h["reserved_micros"]
        a.dirty = True
        h.update(status="voided", charged_micros=0, settled_at=self.now)
        self.touch(h)

    # -- evidence ------------------------------------------------------------------------
    def append(self, kind: str, payload: dict[str, Any], ids: dict[str, Any]) -> EvidenceRecord:
        """Append one evidence record to the chain, in this transaction.

        The record is checked first, so both backends refuse what one of them could not store (SQLite takes
        NaN and NUL bytes that Postgres refuses): InvalidLedgerInput, and the write that appended it fails alone.
        """
        check_ids(kind, ids)
        row = next_record(self.head, self.now, kind, payload, ids, self.signer)
        text = payload_json(kind, row["payload"])
        self.evidence.append(row)
        self._payload_texts.append(text)
        self.head = (row["seq"], row["hash"])
        return EvidenceRecord.model_construct(**row)

    # -- the end of the transaction ------------------------------------------------------
    def flush(self) -> None:
        sql, cur = self.sql, self.cur
        self.alerts = crossed([a for a in self.accounts.values() if a.dirty and a.kept])
        if self.alerts:
            self.append("budget-alert", {"alerts": [a.model_dump() for a in self.alerts]}, NO_IDS)
        for budget, cfg in sorted(self.config_changes.items()):
            values = dict(v_limit=cfg.limit, v_unit=cfg.unit, v_rolling=cfg.rolling, v_version=cfg.version, v_at=self.now)
            if budget in self._configs_stored:
                sql.limit_update.run(cur, k_budget=budget, **values)
            else:
                sql.limit_insert.run(cur, v_budget=budget, **values)
            sql.account_limit_update.run(cur, k_budget=budget, v_limit=cfg.limit, v_unit=cfg.unit)
        for a in sorted((a for a in self.accounts.values() if a.new and a.kept), key=lambda a: (a.budget, a.period)):
            sql.account_insert.run(cur, v_budget=a.budget, v_period=a.period, v_limit=a.limit, v_unit=a.unit)
            a.new, a.dirty = False, True
        dirty = sorted((a for a in self.accounts.values() if a.dirty and not a.new), key=lambda a: (a.budget, a.period))
        if dirty:
            sql.account_update.many(cur, [dict(k_budget=a.budget, k_period=a.period, v_limit=a.limit, v_pending=a.pending,
                                               v_posted=a.posted, v_alerted=a.alerted, v_unit=a.unit, v_carry=a.carry)
                                          for a in dirty])
        if self.new_holds:
            sql.hold_insert.rows(cur, HOLD_VALUES, [tuple(map(self.holds[i].__getitem__, HOLD_COLUMNS))
                                                    for i in sorted(self.new_holds)])
        changed = self.dirty_holds - self.new_holds
        if changed:
            sql.hold_update.many(cur, [{"k_id": i, "v_status": self.holds[i]["status"], "v_charged": self.holds[i]["charged_micros"],
                                        "v_settled": self.holds[i]["settled_at"], "v_lease": self.holds[i]["lease_until"]}
                                       for i in sorted(changed)])
        if self.evidence:
            sql.evidence_insert.rows(cur, EVIDENCE_VALUES, [tuple(text if c == "payload" else r[c] for c in EVIDENCE_COLUMNS)
                                                    for r, text in zip(self.evidence, self._payload_texts)])
            sql.head_update.run(cur, v_seq=self.head[0], v_hash=self.head[1])
