"""Read a slice of the Philly trace (`data/philly.csv`) as jobs for the simulator, without reordering it.

Jobs submitted in the same second keep the file's order; jobs wider than one
host are kept (they run as gangs on whole hosts); only jobs wider than the
whole cluster, jobs without a duration and (with `--tenants`) jobs of the
less busy tenants are left out, and how many is reported.
"""

from __future__ import annotations

import csv
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

from dask_gpu.sim.policies import Job

TRACE = Path(__file__).resolve().parent.parent / "data" / "philly.csv"


class BadTime(ValueError):
    """A --start/--end that is not a date: give 'YYYY-MM-DD' or 'YYYY-MM-DD HH:MM[:SS]' (UTC)."""


def epoch(text: str) -> float:
    """Seconds since 1970 of a UTC date or 'date time'.

    >>> epoch("2017-10-02"), epoch("2017-10-02 06:00"), epoch("2017-10-02T06:00:30")
    (1506902400.0, 1506924000.0, 1506924030.0)
    """
    try:
        return datetime.fromisoformat(text.strip()).replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        raise BadTime(f"{text!r} is not a time: give 'YYYY-MM-DD' or 'YYYY-MM-DD HH:MM[:SS]' (UTC)") from None


def load(path: Path, start: str, end: str, hosts: int, gpus_per_host: int, max_duration: float | None, long: str,
         tenants: int | None) -> tuple[list[Job], dict[int, float], dict[str, int]]:
    """Jobs submitted in [start, end), their real durations, and what was left out (reason -> count)."""
    lo, hi = epoch(start), epoch(end)
    rows = []
    dropped: Counter[str] = Counter()
    with open(path) as f:
        for r in csv.DictReader(f):
            t = epoch(r["timestamp"])
            if not lo <= t < hi:
                continue
            gpus, duration = int(r["num_gpus"]), float(r["duration"])
            if gpus > hosts * gpus_per_host:
                dropped["wider than the cluster"] += 1
                continue
            if duration <= 0:
                dropped["no duration"] += 1
                continue
            if max_duration is not None and duration > max_duration:
                if long == "drop":
                    dropped["longer than --max-duration"] += 1
                    continue
                duration = max_duration
            rows.append((t, r["cluster"], gpus, duration))
    if tenants is not None:
        work: Counter[str] = Counter()
        for _, tenant, gpus, duration in rows:
            work[tenant] += gpus * duration
        keep = {t for t, _ in work.most_common(tenants)}
        dropped["not among the busiest tenants"] += sum(1 for r in rows if r[1] not in keep)
        rows = [r for r in rows if r[1] in keep]
    rows.sort(key=lambda r: r[0])  # stable: jobs of the same second stay in file order
    jobs = [Job(id=i, tenant=tenant, gpus=gpus, submit=t, estimate=duration) for i, (t, tenant, gpus, duration) in enumerate(rows)]
    return jobs, {j.id: j.estimate for j in jobs}, {k: v for k, v in dropped.items() if v}


def offered_load(jobs: list[Job], durations: dict[int, float], capacity: int, end: str) -> float:
    """GPU-seconds asked for / (GPUs x the span from the first submit to the end of the window)."""
    span = epoch(end) - min(j.submit for j in jobs)
    return sum(j.gpus * durations[j.id] for j in jobs) / (capacity * span)
