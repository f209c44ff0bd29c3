"""report_usage refuses values no budget can book (NaN, inf, huge) before it reports anything."""

from __future__ import annotations

import math

import pytest

from aisched_prefect import InvalidUsage, report_usage


@pytest.mark.parametrize("kw", [{"cost": math.inf}, {"cost": math.nan}, {"tokens": math.inf}, {"cost": 1e300}])
def test_reported_usage_must_be_a_finite_number(kw):
    with pytest.raises(InvalidUsage, match=next(iter(kw))):
        report_usage(**kw)
