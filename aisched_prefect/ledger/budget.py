"""Budget holds: reserve, settle, renew and expire, each a write the group commit runs.

A hold is a two-phase reservation. `reserve` takes one hold on every account
the run must fit, or none: one *group*. The group is what is renewed, what
expires and what is settled: never one account's hold without the others', so
a parent's posted and held stay the exact sum of its children's. Each group has
a lease its holder renews while the task runs; a group whose lease ran out (its
process died) expires, charged in full, because nobody knows what ran. Expiry
is lazy (a reservation that would not fit first expires what ran out on its
accounts), and `expire` sweeps everything (the CLI calls it).
"""

from __future__ import annotations

import uuid
from typing import Any

from aisched_prefect.evidence import EvidenceRecord
from aisched_prefect.ledger.amounts import FEMTOS, MICROS, from_micros
from aisched_prefect.ledger.limits import Line, apply_line
from aisched_prefect.ledger.records import BudgetExceeded, Hold, Settlement

Op = Any  # a callable taking the transaction's WriteBatch
EXPIRY_RULE = "a hold whose lease ran out is charged in full: its task's outcome is unknown"


def reserve_op(lines: list[Line], lease: float, kind: str, payload: dict[str, Any], ids: dict[str, Any]) -> Op:
    """Hold each line's amount on its account (all or none) and record `kind` evidence."""

    def op(w: Any) -> tuple[list[Hold], EvidenceRecord]:
        accts = []
        for line in lines:  # checked_lines sorted them: accounts are always taken in key order
            acct = w.account(line.budget, line.period, create=(line.limit, line.unit))
            apply_line(w, acct, line)
            accts.append(acct)
        for acct, line in zip(accts, lines):
            if line.want > acct.free:
                expire_account(w, acct)  # lazily: only a reservation that needs the room looks for run-out leases
            if line.want > acct.free:
                raise BudgetExceeded(acct.budget, acct.period, acct.limit, acct.pending, acct.posted, line.want, acct.unit)
        for acct in accts:  # it fits: a new account is written with it (a refused one leaves none behind)
            w.keep(acct)
        group = str(uuid.uuid4())
        taken: list[dict[str, Any]] = []
        new: list[dict[str, Any]] = []
        for acct, line in zip(accts, lines):
            remaining = acct.free
            acct.pending += line.want
            acct.dirty = True
            hold_id = group if not new else str(uuid.uuid4())
            h = dict(id=hold_id, budget=acct.budget, period=acct.period, reserved_micros=line.want, charged_micros=None,
                     status="pending", created_at=w.now, settled_at=None, unit=acct.unit, lease_until=w.now + lease,
                     group_id=group, reserved_seq=None, **ids)
            w.add_hold(h)
            new.append(h)
            taken.append(dict(id=hold_id, budget=acct.budget, period=acct.period, reserved=from_micros(line.want),
                              remaining_before=from_micros(remaining), remaining_after=from_micros(acct.free),
                              unit=acct.unit, group=group))
        rec = w.append(kind, {**payload, "holds": taken}, ids)
        for h in new:
            h["reserved_seq"] = rec.seq
        return [Hold.model_construct(**t) for t in taken], rec

    return op


def _order(h: dict[str, Any]) -> tuple[Any, ...]:
    """A run's holds on one account share its charge in the order they were taken (the first, then top-ups)."""
    seq = h["reserved_seq"]
    return (h["budget"], h["period"], -1 if seq is None else seq, h["created_at"], h["id"])


def _post_sets(w: Any, items: list[tuple[dict[str, Any], int]], covered: dict[str, int], status: str = "posted") -> None:
    """Post each hold its charge (femto-units); the holds of one reservation with one charge post one amount."""
    sets: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for h, charge in items:
        sets.setdefault((h["group_id"], h["reserved_micros"], charge), []).append(h)
    for (_, _, charge), members in sets.items():
        while members:  # each account once per post (a hold migrated from before groups may repeat one)
            seen: set[tuple[str, str]] = set()
            now, later = [], []
            for h in members:
                (later if (h["budget"], h["period"]) in seen else now).append(h)
                seen.add((h["budget"], h["period"]))
            done = w.post(now, charge, status)
            for h in now:
                covered[h["id"]] = done
            members = later


def settle_op(hold_ids: list[str], actual: int | dict[str, int] | None, kind: str, payload: dict[str, Any],
              ids: dict[str, Any]) -> Op:
    """Post the actual charge (femto-units) on the holds' groups and release the rest, exactly once."""

    def op(w: Any) -> tuple[list[Settlement], EvidenceRecord | None]:
        found = [h for g in w.groups_of(hold_ids) for h in w.group(g)]
        for key in sorted({(h["budget"], h["period"]) for h in found}):
            w.account(*key)
        found.sort(key=_order)
        done: dict[str, dict[str, Any]] = {}
        charge: dict[str, int] = {}
        left: dict[str, int] = {}
        last_of = {h["budget"]: h["id"] for h in found if h["status"] == "pending"}
        for h in found:
            if h["status"] != "pending":
                charged = h["charged_micros"] or 0
                done[h["id"]] = dict(hold_id=h["id"], charged=from_micros(charged),
                                     released=from_micros(h["reserved_micros"] - charged), uncovered=0.0,
                                     status=h["status"], first=False, budget=h["budget"], unit=h["unit"])
            elif actual is None or (isinstance(actual, dict) and h["budget"] not in actual):
                w.void(h)
                done[h["id"]] = dict(hold_id=h["id"], charged=0.0, released=from_micros(h["reserved_micros"]),
                                     uncovered=0.0, status="voided", first=True, budget=h["budget"], unit=h["unit"])
            else:
                b = h["budget"]
                if b not in left:
                    left[b] = actual[b] if isinstance(actual, dict) else actual
                share = left[b] if last_of[b] == h["id"] else min(left[b], h["reserved_micros"] * FEMTOS)
                left[b] -= share
                charge[h["id"]] = share
        # Charges within their holds post as they are; above them, only the share of the excess that
        # *every* account of the settlement has room for, so nested budgets stay equal.
        covered: dict[str, int] = {}
        within = [(w.holds[i], c) for i, c in charge.items() if c <= w.holds[i]["reserved_micros"] * FEMTOS]
        over = [(w.holds[i], c) for i, c in charge.items() if c > w.holds[i]["reserved_micros"] * FEMTOS]
        _post_sets(w, within, covered)
        if over:
            excess: dict[tuple[str, str], int] = {}
            for h, c in over:
                key = (h["budget"], h["period"])
                excess[key] = excess.get(key, 0) + c - h["reserved_micros"] * FEMTOS
            num, den = 1, 1  # the share of each excess that posts: the smallest room / excess of any account
            for key, x in excess.items():
                room = max(w.accounts[key].free, 0) * FEMTOS
                if room * den < num * x:
                    num, den = room, x
            _post_sets(w, [(h, h["reserved_micros"] * FEMTOS + (c - h["reserved_micros"] * FEMTOS) * num // den)
                           for h, c in over], covered)
        for i, c in charge.items():
            h = w.holds[i]
            done[i] = dict(hold_id=i, charged=from_micros(h["charged_micros"]),
                           released=from_micros(max(h["reserved_micros"] - h["charged_micros"], 0)),
                           uncovered=(c - covered[i]) / (MICROS * FEMTOS), status="posted", first=True,
                           budget=h["budget"], unit=h["unit"])
        out = [done[h["id"]] for h in found]
        settled = [Settlement.model_construct(**d) for d in out]
        if not any(d["first"] for d in out):  # settled before: nothing changes, nothing is recorded
            return settled, None
        return settled, w.append(kind, {**payload, "settlements": out}, ids)

    return op


def renew_op(hold_ids: list[str], lease: float) -> Op:
    """Extend the lease of the holds' groups whose lease has not run out; returns the hold ids renewed."""

    def op(w: Any) -> set[str]:
        renewed: set[str] = set()
        for g in w.groups_of(hold_ids, missing_ok=True):
            hs = [h for h in w.group(g) if h["status"] == "pending"]
            if not hs or any(h["lease_until"] is None or h["lease_until"] < w.now for h in hs):
                continue  # a lease that ran out is not revived: the group is spent, whatever ran
            for h in hs:
                h["lease_until"] = w.now + lease
                w.touch(h)
                renewed.add(h["id"])
        return renewed

    return op


def expire_groups(w: Any, groups: list[str]) -> list[dict[str, Any]]:
    """Expire these groups whose lease ran out, every hold charged in full; one record per account."""
    by_account: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for g in groups:
        hs = [h for h in w.group(g) if h["status"] == "pending"]
        if not hs or not any(h["lease_until"] is not None and h["lease_until"] < w.now for h in hs):
            continue  # renewed, or settled, earlier in this transaction
        for h in hs:
            w.account(h["budget"], h["period"])
            by_account.setdefault((h["budget"], h["period"]), []).append(h)
        # The holds of one size post together: one amount on every account, also where a cut limit caps it.
        _post_sets(w, [(h, h["reserved_micros"] * FEMTOS) for h in sorted(hs, key=_order)], {}, "expired")
    gone = []
    for (budget, period), hs in sorted(by_account.items()):
        w.append("hold-expired", {
            "budget": budget, "period": period, "unit": hs[0]["unit"],
            "holds": [{"id": h["id"], "task_run_id": h["task_run_id"], "charged": from_micros(h["charged_micros"]),
                       "group": h["group_id"],
                       # written off: a limit cut below what was held had no room for the whole hold
                       **({"uncovered": from_micros(h["reserved_micros"] - h["charged_micros"])}
                          if h["charged_micros"] < h["reserved_micros"] else {})} for h in hs],
            "rule": EXPIRY_RULE}, {"flow_run_id": None, "task_run_id": None, "principal": None})
        gone += hs
    return gone


def expire_account(w: Any, acct: Any) -> list[dict[str, Any]]:
    """Expire the groups with a run-out hold on this account (and so their holds on every other account)."""
    rows = w.sql.expired_on_account.run(w.cur, k_budget=acct.budget, k_period=acct.period, k_now=w.now).fetchall()
    return expire_groups(w, sorted({r[0] for r in rows}))


def expire_op() -> Op:
    """A write that expires every group whose lease ran out; returns the hold ids expired."""

    def op(w: Any) -> list[str]:
        rows = w.sql.expired.run(w.cur, k_now=w.now).fetchall()
        return [h["id"] for h in expire_groups(w, sorted({r[0] for r in rows}))]

    return op
