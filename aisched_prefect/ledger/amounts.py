"""Amounts in the books: checked at the ledger's door, held in micro-units, charged without drift.

Every amount is stored as an integer number of micro-units (1e-6) of its account's
unit (money, GPU-hours or tokens), so the books balance exactly. A charge is rarely
a whole number of micro-units (2/3600 GPU-hours, 1/300 USD), and rounding each one
on its own drifts without bound: 2,000 charges of 4e-7 would post nothing. So each
account keeps a *carry*, what it posted minus the true sum of its charges, in
femto-units (1e-15), and each charge posts the micro-units that keep every carry
within one micro-unit: any number of charges posts their true sum within one
micro-unit, and a charge posts exactly its rounded self whenever that stays within.

The accounts of one run are charged the same micro-units for the same charge (one
`post_amount` for all of them), so a parent's books stay the exact sum of its
children's.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from aisched_prefect.errors import InvalidAmount
from blocks.budget import MAX_AMOUNT

MICROS = 1_000_000
FEMTOS = 1_000_000_000  # femto-units per micro-unit: the resolution of a charge and of the carry
MAX_LEASE_SECONDS = 30 * 86_400.0


def to_micros(amount: float) -> int:
    """An amount in micro-units, rounded to the nearest (limits and reports)."""
    return int(round(amount * MICROS))


def from_micros(micros: int) -> float:
    return micros / MICROS


def check_amount(what: str, value: object, *, fix: str = "pass a number from 0 to 1e12") -> float:
    """`value` as a float, if it is a finite number from 0 to MAX_AMOUNT; else InvalidAmount naming `what`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidAmount(what, value, "an amount must be a number", fix)
    try:
        v = float(value)
    except OverflowError:
        raise InvalidAmount(what, value, f"an amount must be at most {MAX_AMOUNT:g}", fix) from None
    if not math.isfinite(v):
        raise InvalidAmount(what, value, "an amount must be finite, not NaN or infinite", fix)
    if v < 0:
        raise InvalidAmount(what, value, "an amount cannot be negative", fix)
    if v > MAX_AMOUNT:
        raise InvalidAmount(what, value, f"an amount must be at most {MAX_AMOUNT:g}", fix)
    return v


def check_lease(value: object) -> float:
    """A lease length in seconds: finite, above 0, at most 30 days."""
    fix = "pass lease_seconds above 0 and at most 30 days (e.g. 300)"
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise InvalidAmount("lease_seconds", value, "a lease must be a finite number of seconds", fix)
    if not 0 < float(value) <= MAX_LEASE_SECONDS:
        raise InvalidAmount("lease_seconds", value, "a lease must be above 0 and at most 30 days", fix)
    return float(value)


def femtos(amount: float) -> int:
    """The amount in femto-units, from the float's exact value (no floating-point error), rounded half up."""
    n, d = float(amount).as_integer_ratio()
    return (2 * n * MICROS * FEMTOS + d) // (2 * d)


def hold_micros(amount: float) -> int:
    """What a hold of `amount` takes, in micro-units: rounded up, so a hold always covers what it was asked."""
    return -(-femtos(amount) // FEMTOS)


def post_amount(charge: int, carries: Sequence[int], cap: int) -> tuple[int, int]:
    """Micro-units to post for `charge` (femto-units) on accounts with these carries, at most `cap`.

    Returns (micro-units, the part of `charge` they stand for): the whole charge,
    unless the cap cut it, when the rest is not posted (uncovered). The
    micro-units are the charge rounded to the nearest, moved by one where needed
    to keep every carry within (-1, 1) micro-units. Where no amount keeps all
    of them in (accounts whose carries differ by more than a micro-unit), the
    one in the middle of what each would allow.
    """
    lo = max(charge - c - FEMTOS for c in carries)  # posted * FEMTOS must lie strictly between lo and hi
    hi = min(charge - c + FEMTOS for c in carries)
    first, last = lo // FEMTOS + 1, -(-hi // FEMTOS) - 1
    nearest = (charge + FEMTOS // 2) // FEMTOS
    if first <= last:
        posted = min(max(nearest, first), last)
    else:
        posted = (lo + hi + FEMTOS) // (2 * FEMTOS)
    posted = max(posted, 0)
    if posted <= cap:
        return posted, charge
    # Capped: the posted micro-units stand for themselves where that keeps every carry within a micro-unit (as an
    # expiry's evidence says: a hold charged in whole micro-units, the rest written off in whole micro-units);
    # else for the charge that leaves the carries centred (a lone account's at 0). Centring always had carries
    # moved by a fraction at an expiry whose record says none was charged, so the books drifted from the evidence.
    exact = min(charge, cap * FEMTOS)
    if all(-FEMTOS < c + cap * FEMTOS - exact < FEMTOS for c in carries):
        return cap, exact
    return cap, max(0, min(charge, cap * FEMTOS + (min(carries) + max(carries)) // 2))
