"""Moved to `dask_gpu.sim.simulator` (pure, no Prefect); this name stays so older imports keep working."""

from dask_gpu.sim.metrics import jain, lower_bound, percentile  # noqa: F401
from dask_gpu.sim.simulator import Outcome, alone, simulate  # noqa: F401
