"""Which waiting runs start now, and where: every queue policy and its helpers, named in one place.

The code lives in `dask_gpu.policies` (the interface, placement helpers, one module per policy) and, for the
simulator's baselines, `dask_gpu.sim.baselines`; this module re-exports their public names, so
`from dask_gpu.sim.policies import FinishTimeFair` keeps working.

Phases of one decision (every policy): 1. order the waiting jobs; 2. start
from the front while jobs fit; 3. reserve room for the first that does not
(EASY), and 4. backfill later jobs that cannot delay a reservation.

Policies:
- `PlainDask`: a model of plain Dask, for comparison: each job goes to a host
  at submit (least occupancy: queued plus remaining running GPU-seconds per
  GPU), each host runs its own queue first in first out (Dask's priorities:
  older submits first), and a head that does not fit blocks the jobs behind it.
- `Fifo`: one queue for the cluster, strictly in submit order.
- `EasyBackfill`: FIFO with EASY backfill (the head gets a reservation; later
  jobs may start now if they cannot delay it).
- `SjfEasy`, `Las2D`, `MaxMinFair`: baselines for the simulator with EASY's
  reservation and backfill: smallest estimated work first; Tiresias' 2D-LAS
  (least attained GPU-time, discretised queues, no duration needed); max-min
  fair share between tenants (Gavel/DRF-like).
- `FinishTimeFair`: ours (see its docstring), the live queue's default: shortest
  first, with jobs about to finish much later than they would alone on their
  tenant's share served first; no GPU held idle beyond EASY's reservations.
- `FairShare`: the previous policy (max-min fair share between tenants; its
  `headroom` keeps GPUs idle for newcomers).
"""

from __future__ import annotations

from dask_gpu.policies.fair_share import FairShare
from dask_gpu.policies.fairness_books import FairnessBooks
from dask_gpu.policies.fifo import EasyBackfill, Fifo
from dask_gpu.policies.finish_time_fair import LIVE_HALF_LIFE, FinishTimeFair
from dask_gpu.policies.interface import ClusterState, Holds, Job, Policy, Preemption, Running, Start
from dask_gpu.policies.placement import (
    Reserved,
    best_fit,
    drain_times,
    fits_somewhere,
    gang_fit,
    is_gang,
    max_min_shares,
    member_gpus,
    place,
    reclaim,
    reservation,
    with_starts,
)
from dask_gpu.sim.baselines import Las2D, MaxMinFair, PlainDask, SjfEasy

__all__ = [
    "LIVE_HALF_LIFE", "ClusterState", "EasyBackfill", "FairShare", "FairnessBooks", "Fifo", "FinishTimeFair", "Holds",
    "Job", "Las2D", "MaxMinFair", "PlainDask", "Policy", "Preemption", "Reserved", "Running", "SjfEasy", "Start",
    "best_fit", "drain_times", "fits_somewhere", "gang_fit", "is_gang", "max_min_shares", "member_gpus", "place",
    "reclaim", "reservation", "with_starts",
]
