"""`aisched serve`: run the control plane (or print the public key its workers trust)."""

from __future__ import annotations

from typing import Optional

import typer


def serve(host: str = typer.Option("127.0.0.1", help="Address to listen on."),
          port: int = typer.Option(8790, help="Port (0: any free one)."),
          dask_address: Optional[str] = typer.Option(None, "--dask-address", help="An existing GPU Dask cluster; "
                                                     "default: a local one of this host's GPUs (or --declared)."),
          declared: Optional[str] = typer.Option(None, help="Declared inventory of the local cluster."),
          queue: bool = typer.Option(True, "--queue/--no-queue", help="Every GPU run waits in the cluster's one "
                                     "fair-share queue (the default); --no-queue hands runs to Dask directly."),
          checkpoint_dir: Optional[str] = typer.Option(None, "--checkpoint-dir",
                                                       help="Publish signed checkpoints of the evidence here."),
          dask_tls: Optional[str] = typer.Option(None, "--dask-tls", help="TLS files of an existing cluster "
                                                 "(ca.pem, client.pem, client.key; `dask-gpu-scheduler` writes them)."),
          public_url: Optional[str] = typer.Option(None, "--public-url", help="The URL people reach this control "
                                                   "plane at (approval links point there); default: where it listens."),
          print_key: bool = typer.Option(False, "--print-key", help="Print the public key workers trust (made at "
                                         "AISCHED_HOME/control.key on first use) and exit.")) -> None:
    """Run the control plane: the only holder of the ledger, the signing key and the Dask client.

    Prints one JSON line when ready: its URL, its public key (workers of an existing cluster trust it:
    `dask-gpu-worker ... --trust-key KEY`), and on first start where the operator token was written.
    """
    if print_key:  # what workers trust: the raw Ed25519 public key, as dask_gpu.tickets.TicketSigner reads it
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        from aisched_prefect.control.authority.keys import load_or_make_key
        from aisched_prefect.settings import settings

        key = load_or_make_key(settings().home / "control.key")
        typer.echo(key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex())
        return
    from aisched_prefect.control.server import serve as run

    run(host=host, port=port, dask_address=dask_address, declared=declared, queue=queue, checkpoint_dir=checkpoint_dir,
        dask_tls=dask_tls, public_url=public_url)
