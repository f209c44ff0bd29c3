"""`dask-gpu-slurm CONFIG`: GPU worker jobs on Slurm that follow the cluster's queue (dask_gpu.slurm_scaler).

    dask-gpu-slurm slurm-workers.yaml          # runs until SIGTERM/SIGINT, then gives back every job it submitted

CONFIG is YAML (every field: docs/how-to/slurm-kubernetes.md):

    scheduler: tls://login1:8786
    tls_dir: /etc/aisched/tls
    trust_keys: [KEY]                          # what `aisched serve --print-key` prints
    policy:
      max_jobs: 8                              # worker jobs over all groups, pending or running
      idle_seconds: 120                        # an idle worker is given back after this (beyond min_jobs)
      groups:
        - {name: h100-team-a, gpu_type: H100, gpus: 4, tenant: team-a, max_jobs: 4, partition: gpu}

It needs dask-jobqueue (`pip install 'aisched-prefect[slurm]'`) and Slurm's clients (sbatch, squeue, scancel,
scontrol) on this host.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from dask_gpu.errors import DaskGPUError

PROG = "dask-gpu-slurm"


async def _serve(path: str) -> None:
    from dask_gpu.slurm_scaler import SlurmScaler, load_settings

    settings = load_settings(path)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with SlurmScaler(settings) as scaler:
        groups = ", ".join(f"{g.name} ({g.gpus} x {g.gpu_type}, {g.tenant or 'every tenant'}, "
                           f"{g.min_jobs}-{g.max_jobs} jobs)" for g in settings.policy.groups)
        print(f"{PROG}: following the queue of {settings.scheduler}: {groups}; at most {settings.policy.max_jobs} "
              "jobs", file=sys.stderr, flush=True)
        await scaler.run(stop)
        print(f"{PROG}: stopping: giving back {len(scaler.jobs)} job(s)", file=sys.stderr, flush=True)
    print(f"{PROG}: stopped", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or len(args) != 1:
        print(__doc__)
        sys.exit(0 if args and args[0] in ("-h", "--help") else 2)
    logging.basicConfig(level=logging.WARNING, format=f"{PROG}: %(message)s", stream=sys.stderr)
    try:
        asyncio.run(_serve(args[0]))
    except DaskGPUError as exc:
        sys.exit(f"{PROG}: {exc}")


if __name__ == "__main__":  # pragma: no cover
    main()
