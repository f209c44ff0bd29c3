"""Moved to `dask_gpu.simulator` (pure, no Prefect); this name stays so older imports keep working."""

from dask_gpu.sim_metrics import jain, lower_bound, percentile  # noqa: F401
from dask_gpu.simulator import Outcome, alone, simulate  # noqa: F401
