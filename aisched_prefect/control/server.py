"""Running a control plane: `aisched serve` (shared, operators in charge) or embedded (one flow run's own).

The embedded mode is what Prefect's temporary server is to Prefect: with no
control plane configured, the runner starts one for its flow run, hands it
the blocks it names (on stdin) and gets back a credential bound to them. It
has no authority boundary (the flow that starts it is its operator) and
reaches no cluster but the local one it starts; production runs `aisched serve`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger("aisched_prefect.control")


def _listen(host: str, port: int) -> socket.socket:
    """The plane's listening socket, or one line naming the port and the fix."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise SystemExit(f"aisched serve: cannot listen on {host}:{port} ({exc.strerror or exc}). Fix: stop what "
                         "listens there, or pass --port with a free port (and give flows the new address)") from None
    sock.set_inheritable(True)
    return sock


def _control_plane(config: Any, **kw: Any) -> Any:
    """The plane, or one line naming its ledger (password hidden) and the fix where its database does not answer."""
    from aisched_prefect.control.service import ControlPlane
    from aisched_prefect.errors import LedgerUnavailable
    from aisched_prefect.ledger.engine import database_errors, described, safe_url

    try:
        return ControlPlane(config, **kw)
    except (LedgerUnavailable, *database_errors()) as exc:  # an operator's setting: one line, not a traceback
        raise SystemExit(f"aisched serve: cannot open the ledger at {safe_url(config.ledger())} ({described(exc)}). "
                         "Fix: start that database, or set AISCHED_LEDGER_URL to one that answers") from None


def serve(*, host: str = "127.0.0.1", port: int = 8790, dask_address: str | None = None, declared: str | None = None,
          queue: bool = True, checkpoint_dir: str | None = None, embedded: dict[str, Any] | None = None,
          ready: Any = None, print_ready: bool = True, dask_tls: str | None = None,
          public_url: str | None = None) -> None:
    """Start a control plane and serve it until SIGTERM/SIGINT."""
    from aisched_prefect.settings import settings

    config = settings()
    _log_to_stderr()
    early = _start_local_cluster(config, declared, dask_tls) if dask_address is None else None
    try:  # a start that fails before the plane holds its local cluster stops that cluster here
        import uvicorn

        from aisched_prefect.control.http.app import build_app

        sock = _listen(host, port)
        listen_url = f"http://{host}:{sock.getsockname()[1]}"
        base_url = (public_url or listen_url).rstrip("/")  # what approval links point people at
        plane = _control_plane(config, dask_address=dask_address, declared=declared, queue=queue, base_url=base_url,
                               checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir else None,
                               dask_tls=Path(dask_tls) if dask_tls else None, early=early)
    except BaseException:
        if early is not None:
            early.close()  # a no-op once the plane took it (its own stack closed it)
        raise
    plane.listen_host = host  # /metrics is open to loopback scrapes only where the plane listens on loopback alone
    info: dict[str, Any] = {"url": listen_url, "public_url": base_url, "public_key": plane.public_key, "ledger": plane.ledger.url,
                            "dask": plane.client.scheduler.address}
    global _STOP_LEVEL
    try:
        if embedded is not None:
            _STOP_LEVEL = logging.INFO  # the flow stops its own plane: that is not news in the flow's output
            info["token"] = _bootstrap_embedded(plane, embedded)
        else:
            token_file = config.home / "operator.token"
            if plane.credentials.bootstrap_operator(token_file) is not None:
                info["operator_token_file"] = str(token_file)
        grace = config.stop_seconds
        server = _uvicorn_server(uvicorn.Config(build_app(plane), log_level="warning", lifespan="off", timeout_keep_alive=30,
                                        timeout_graceful_shutdown=grace), plane.outcomes.close)  # type: ignore[arg-type]

        def _stop(*_: Any) -> None:  # uvicorn's own handler (_Server.handle_exit) has the signal while it serves
            server.should_exit = True
            plane.outcomes.close()

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _stop)
            signal.signal(signal.SIGINT, _stop)
        started = threading.Event()

        def _announce() -> None:
            while not server.started and not server.should_exit:
                threading.Event().wait(0.02)
            started.set()
            if print_ready:
                print(json.dumps(info), flush=True)
            if ready is not None:
                ready(info)

        threading.Thread(target=_announce, daemon=True).start()
        server.run(sockets=[sock])
    finally:
        _close_within(plane, config.stop_seconds)
    _exit_now()  # stopped by a signal, everything closed: the interpreter's own exit would join pools for seconds


_STOP_LEVEL = logging.WARNING  # how `aisched serve` says it stops (an operator's service: a warning)


def _start_local_cluster(config: Any, declared: str | None, dask_tls: str | None) -> Any:
    """The local cluster's processes started first, on a thread, so they import while this process imports the rest
    of the plane (2 to 3 s each, one after the other, before): a flow run's embedded plane is ready that much sooner."""
    from aisched_prefect.control.authority.keys import load_or_make_key
    from aisched_prefect.control.dispatch.scheduler_link import EarlyCluster
    from dask_gpu.tickets import TicketSigner  # the plane's own way to its public key (the workers' trusted key)

    public = TicketSigner(load_or_make_key(config.home / "control.key")).public_key
    return EarlyCluster(config, declared=declared, dask_tls=Path(dask_tls) if dask_tls else None,
                        trusted_key=public.hex())


def _exit_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


def _uvicorn_server(config: Any, on_stop: Any = None) -> Any:
    """uvicorn's server, saying in the log that it stops and why, and ending open long-polls (`on_stop`) so none is
    cut mid-request; a second signal exits at once."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            name = signal.Signals(sig).name
            if self.should_exit:
                logger.warning("aisched serve: %s again: exiting now", name)
                os._exit(128 + sig)
            logger.log(_STOP_LEVEL, "aisched serve: %s: stopping; open requests get %.1f s, then the Dask client "
                       "and the ledger close", name, config.timeout_graceful_shutdown)
            if on_stop is not None:
                on_stop()
            super().handle_exit(sig, frame)

    return Server(config)


def _close_within(plane: Any, seconds: float) -> None:
    """Close the plane (Dask client, chores, ledger); past `seconds`, log what is left and go on to exit.

    Nothing is lost by not waiting: every decision is already a committed row, and a run in flight is settled by
    whichever replica (or restart) takes it over.
    """
    done = threading.Event()

    def _close() -> None:
        try:
            plane.close()
        except Exception:  # the process is exiting: say so, do not mask the reason it stops
            logger.exception("aisched serve: closing failed")
        finally:
            done.set()

    threading.Thread(target=_close, name="aisched-close", daemon=True).start()
    if done.wait(seconds):
        logger.log(_STOP_LEVEL, "aisched serve: stopped")
        return
    logger.warning("aisched serve: stopped (closing had not finished within %.1f s; exiting without waiting)", seconds)
    _exit_now()  # the interpreter would otherwise wait on the Dask client's threads


def _log_to_stderr() -> None:
    """Warnings and errors on stderr (where its ready line's reader is not), also under `aisched serve`."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _bootstrap_embedded(plane: Any, spec: dict[str, Any]) -> str:
    """Apply the blocks the flow named and issue its credential: the flow run is this plane's operator."""
    by = f"embedded:{os.getpid()}"
    names: dict[str, str | None] = {}
    for kind, item in spec.get("configs", {}).items():
        if item is None:
            names[kind] = None
            continue
        plane.configuration.apply(by, kind, item["name"], item["body"])
        names[kind] = item["name"]
    token, _ = plane.credentials.issue(by, principal=spec["principal"], tenant=spec["tenant"], role="flow",
                                       authority=names.get("authority"), budget=names.get("budget"),
                                       policy=names.get("policy"), cluster=names.get("cluster"))
    return token


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m aisched_prefect.control.server", allow_abbrev=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--dask-address", default=None)
    parser.add_argument("--dask-tls", default=None, help="directory with ca.pem, client.pem, client.key")
    parser.add_argument("--public-url", default=None, help="the URL people reach this control plane at")
    parser.add_argument("--declared", default=None)
    parser.add_argument("--queue", action="store_true", default=True,
                        help="every GPU run waits in the cluster's one queue (the default)")
    parser.add_argument("--no-queue", dest="queue", action="store_false",
                        help="hand GPU runs to Dask directly (Dask's resources, no fairness across flows)")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--embedded", action="store_true", help="read the flow's blocks on stdin (JSON)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    embedded = json.loads(sys.stdin.readline()) if args.embedded else None
    serve(host=args.host, port=args.port, dask_address=args.dask_address, declared=args.declared, queue=args.queue,
          checkpoint_dir=args.checkpoint_dir, embedded=embedded, dask_tls=args.dask_tls, public_url=args.public_url)


if __name__ == "__main__":
    main()
