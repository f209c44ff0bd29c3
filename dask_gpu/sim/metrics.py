"""Figures of merit for a replayed schedule: percentiles, lower bound, Jain, finish-time fairness (Themis).

Pure functions over numbers; the simulator (`dask_gpu.sim.simulator`) feeds them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0-100), linearly interpolated between closest ranks (numpy's default).

    >>> percentile([1, 2, 3, 4], 50), percentile([10, 20], 95), percentile([5], 99)
    (2.5, 19.5, 5.0)
    """
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def jain(values: list[float]) -> float:
    """Jain's index: 1 when all equal, 1/n when one value holds everything (information only).

    >>> jain([1, 1, 1]), jain([1, 0])
    (1.0, 0.5)
    """
    return (sum(values) ** 2) / (len(values) * sum(v * v for v in values)) if values and any(values) else 1.0


def lower_bound(submits: list[float], work: list[float], longest: list[float], gpus: int) -> float:
    """LB+: no schedule can finish earlier, measured from the first submit.

    `submits`, `work` (GPU-seconds) and `longest` (seconds) are per job, in any order.

    >>> lower_bound([0.0, 0.0], [40.0, 40.0], [10.0, 10.0], 4)
    20.0
    """
    t0 = min(submits)
    bound = max(sum(work) / gpus, max(s - t0 + d for s, d in zip(submits, longest)))
    later = 0.0
    for s, w in sorted(zip(submits, work), reverse=True):  # t + work submitted at or after t, / GPUs
        later += w
        bound = max(bound, s - t0 + later / gpus)
    return bound


def private_pool(hosts: int, gpus_per_host: int, tenants: float, widest: int) -> list[int]:
    """A tenant's private pool for finish-time fairness: max(floor(H*G/N), its widest job) GPUs, as hosts of
    G GPUs (the last one smaller if it does not divide). N may be fractional (Themis' average contention).

    >>> private_pool(8, 8, 10, 4), private_pool(8, 8, 10, 8), private_pool(8, 8, 10, 12), private_pool(8, 8, 2.5, 1)
    ([6], [8], [8, 4], [8, 8, 8, 1])
    """
    gpus = max(int(hosts * gpus_per_host // max(tenants, 1)), widest)
    return [gpus_per_host] * (gpus // gpus_per_host) + ([gpus % gpus_per_host] if gpus % gpus_per_host else [])


def finish_time_fairness(shared: Mapping[str, float], alone: Mapping[str, float]) -> dict[str, float]:
    """rho per tenant (Themis): the sum of its jobs' completion times in the shared cluster over the same sum
    when its jobs run alone on its private pool; 1 is as good as alone, above 1 worse.

    >>> finish_time_fairness({"a": 30.0, "b": 10.0}, {"a": 20.0, "b": 10.0})
    {'a': 1.5, 'b': 1.0}
    """
    return {t: shared[t] / alone[t] for t in shared if alone.get(t)}
