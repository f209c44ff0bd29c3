"""`dask-gpu-worker`: `dask worker` with the GPU preload, for hosts that join an existing scheduler.

    dask-gpu-worker tcp://scheduler:8786 --nthreads 9
    dask-gpu-worker tcp://scheduler:8786 --declared "4 GPUs, 24 GB, L4"   # no NVML: declare them

Every other option is `dask worker`'s own.
"""

from __future__ import annotations

import os
import sys

from dask_gpu.cluster import PRELOAD
from dask_gpu.inventory import DECLARED_ENV, discover


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--declared" in args:
        i = args.index("--declared")
        if i + 1 >= len(args):
            sys.exit("dask-gpu-worker: --declared needs a value, e.g. --declared '2 GPUs, 80 GB, H100'")
        os.environ[DECLARED_ENV] = args[i + 1]
        del args[i : i + 2]
        discover()  # a bad spec fails here, with its message, not inside the worker
    from distributed.cli.dask_worker import main as dask_worker

    dask_worker.main(args=[*args, "--preload", PRELOAD], prog_name="dask-gpu-worker")


if __name__ == "__main__":  # pragma: no cover
    main()
