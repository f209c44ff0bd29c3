"""Multi-host jobs: one process per host, and the rendezvous environment torchrun and DeepSpeed read.

A run wider than every worker (or with `hosts=N`) is a *gang*: it gets whole
workers, all at once, and its body runs once on each of them, in its own
process, with:

=====================  ==========================================================
``MASTER_ADDR``        the host of member 0 (where a rendezvous listens)
``MASTER_PORT``        a port member 0's worker found free on that host
``WORLD_SIZE``         the number of hosts (members); torchrun's ``--nnodes``
``RANK``/``NODE_RANK`` this member's index, 0 .. WORLD_SIZE-1; ``--node-rank``
``LOCAL_RANK``         0: one process per host (torchrun starts the per-GPU ones)
``NPROC_PER_NODE``     how many GPUs this member holds; ``--nproc-per-node``
``CUDA_VISIBLE_DEVICES``  exactly those GPUs
=====================  ==========================================================

so a body starts one torchrun per host with::

    from dask_gpu import run_subprocess, torchrun_args

    run_subprocess(torchrun_args("train.py", "--epochs", "3"), check=True)

(torchrun then sets RANK, WORLD_SIZE and LOCAL_RANK of each per-GPU process it
starts, counting GPUs). A run on one host gets the same variables, with
WORLD_SIZE 1 and MASTER_ADDR 127.0.0.1, and `torchrun_args` says `--standalone`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

GANG_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "NODE_RANK", "LOCAL_RANK", "NPROC_PER_NODE")


class Rendezvous(BaseModel):
    """Where the members of one run meet, as this member sees it."""

    model_config = ConfigDict(frozen=True)

    master_addr: str
    master_port: int
    world_size: int  # hosts
    rank: int  # this host's index
    nproc_per_node: int  # GPUs this host holds

    def env(self, devices: int | None = None) -> dict[str, str]:
        return {"MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
                "WORLD_SIZE": str(self.world_size), "RANK": str(self.rank), "NODE_RANK": str(self.rank),
                "LOCAL_RANK": "0", "NPROC_PER_NODE": str(self.nproc_per_node if devices is None else devices)}


def rendezvous() -> Rendezvous:
    """This member's rendezvous, read from the environment its worker set (inside an AI task's body)."""
    missing = [k for k in GANG_ENV if k not in os.environ]
    if missing:
        from dask_gpu.errors import NotOnGPUWorker

        raise NotOnGPUWorker(f"rendezvous() outside a GPU task's body: {', '.join(missing)} not set")
    e = os.environ
    return Rendezvous(master_addr=e["MASTER_ADDR"], master_port=int(e["MASTER_PORT"]), world_size=int(e["WORLD_SIZE"]),
                      rank=int(e["NODE_RANK"]), nproc_per_node=int(e["NPROC_PER_NODE"]))


def torchrun_args(script: str, *args: str, torchrun: str = "torchrun") -> list[str]:
    """`torchrun ... script args` for this member: multi-node with a static rendezvous at MASTER_ADDR:MASTER_PORT,
    or `--standalone` on one host.

    >>> os.environ.update(MASTER_ADDR="10.0.0.5", MASTER_PORT="29400", WORLD_SIZE="2", RANK="1", NODE_RANK="1",
    ...                   LOCAL_RANK="0", NPROC_PER_NODE="8")
    >>> torchrun_args("train.py", "--epochs", "3")  # doctest: +NORMALIZE_WHITESPACE
    ['torchrun', '--nnodes=2', '--node-rank=1', '--nproc-per-node=8', '--master-addr=10.0.0.5',
     '--master-port=29400', 'train.py', '--epochs', '3']
    """
    r = rendezvous()
    if r.world_size == 1:
        return [torchrun, "--standalone", f"--nproc-per-node={r.nproc_per_node}", script, *args]
    return [torchrun, f"--nnodes={r.world_size}", f"--node-rank={r.rank}", f"--nproc-per-node={r.nproc_per_node}",
            f"--master-addr={r.master_addr}", f"--master-port={r.master_port}", script, *args]


def free_port(host: str) -> int:
    """A TCP port free on `host` now (the OS picks it); member 0's rendezvous listens there."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def members_env(members: Sequence[Sequence[object]], rank: int, devices: int) -> dict[str, str]:
    """The environment of member `rank`, from every member's (host, port) as the registry's meeting returned them."""
    host, port = members[0]
    return Rendezvous(master_addr=str(host), master_port=int(port), world_size=len(members), rank=rank,
                      nproc_per_node=devices).env()
