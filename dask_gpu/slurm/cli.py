"""`dask-gpu-slurm CONFIG`: GPU worker jobs on Slurm that follow the cluster's queue (dask_gpu.slurm.scaler).

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

import argparse
import asyncio
import logging
import signal
import sys

from dask_gpu.errors import DaskGPUError

PROG = "dask-gpu-slurm"


async def _serve(path: str) -> None:
    from dask_gpu.slurm.scaler import SlurmScaler, load_settings

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


def _fields(model: type, indent: str = "  ") -> str:
    """The fields of a configuration model with their defaults: the --help listing, kept from the code."""
    out = []
    for name, field in model.model_fields.items():
        default = "required" if field.is_required() else f"default {field.get_default(call_default_factory=True)!r}"
        out.append(f"{indent}{name} ({default})")
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    from dask_gpu.slurm.scaler import ScalerSettings
    from dask_gpu.slurm.scaling import ScalingPolicy, WorkerGroup

    epilog = (f"CONFIG fields:\n{_fields(ScalerSettings)}\npolicy:\n{_fields(ScalingPolicy)}\n"
              f"policy.groups[]:\n{_fields(WorkerGroup)}\n\nEvery field: docs/how-to/slurm-kubernetes.md")
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", metavar="CONFIG", help="the scaler's YAML configuration (its fields are listed below)")
    p.add_argument("--check", action="store_true",
                   help="read and check CONFIG, print its groups and what admission counts, submit nothing")
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="how much it logs (default WARNING: each job submitted, given back or ended)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level, format=f"{PROG}: %(message)s", stream=sys.stderr)
    try:
        if args.check:
            from dask_gpu.slurm.scaler import load_settings

            settings = load_settings(args.config)
            for g in settings.policy.groups:
                print(f"{g.name}: --gres={g.gres_request}, {g.tenant or 'every tenant'}, {g.min_jobs}-{g.max_jobs} "
                      f"jobs, partition {g.partition or '(default)'}")
            print(f"at most {settings.policy.max_jobs} jobs; a run admitted for a group at 0 jobs waits at most "
                  f"{settings.policy.start_seconds:g} s for its worker")
            return
        asyncio.run(_serve(args.config))
    except DaskGPUError as exc:
        sys.exit(f"{PROG}: {exc}")


if __name__ == "__main__":  # pragma: no cover
    main()
