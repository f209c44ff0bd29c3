"""Who may ask a TLS cluster for what: the control plane's certificate, not a worker's, opens the doors that run code.

Mutual TLS keeps out every process without a certificate of the cluster's CA.
A GPU host holds one (its workers need it to join), and so can a body running
there. The gate tells the certificates apart by their common name: asking the
scheduler to become a client, to broadcast to workers, to run a function or
install a plugin, and asking a worker to run code, add a plugin or hand out
data, is open only to the control plane (`aisched-client`) and, on workers, to
the scheduler relaying it (`aisched-scheduler`). A worker's certificate keeps
what a worker needs: joining, heartbeats, redeeming tickets.

    >>> peer_name({"peercert": {"subject": ((("commonName", "aisched-client"),),)}})
    'aisched-client'
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

from distributed.core import _expects_comm

CLIENT, SCHEDULER = "aisched-client", "aisched-scheduler"
SCHEDULER_OPS = (
    "register-client", "broadcast", "proxy", "run_function", "scatter", "gather", "restart", "restart_workers",
    "register_scheduler_plugin", "unregister_scheduler_plugin", "register_worker_plugin", "unregister_worker_plugin",
    "register_nanny_plugin", "unregister_nanny_plugin", "gpu_queue_run", "gpu_queue_leave", "gpu_queue_status",
    "gpu_limit_acquire", "gpu_limit_release",
)
WORKER_OPS = (
    "run", "run_coroutine", "get_data", "update_data", "gather", "upload_file", "actor_execute", "actor_attribute",
    "plugin-add", "plugin-remove", "gpu_stop", "gpu_renew", "gpu_running_for", "gpu_inventory",
)


def peer_name(extra_info: dict[str, Any] | None) -> str | None:
    """The common name of the certificate the other end of a TLS comm presented (None: no certificate)."""
    cert = (extra_info or {}).get("peercert") or {}
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


def guard(handlers: dict[str, Any], ops: Iterable[str], allowed: set[str], where: str) -> None:
    """Wrap `ops` of `handlers` so that only a peer whose certificate is named in `allowed` gets through."""
    for op in ops:
        handler = handlers.get(op)
        if handler is None or getattr(handler, "_gated", False):
            continue
        expects = _expects_comm(handler)

        async def gated(comm: Any, *, _handler: Any = handler, _op: str = op, _expects: bool = expects, **msg: Any) -> Any:
            name = peer_name(getattr(comm, "extra_info", None))
            if name not in allowed:
                raise PermissionError(f"{where} refuses {_op!r} from a peer presenting {name or 'no certificate'}: only "
                                      f"{' or '.join(sorted(allowed))} may ask for it")
            out = _handler(comm, **msg) if _expects else _handler(**msg)
            if inspect.isawaitable(out):
                out = await out
            return out

        gated._gated = True  # type: ignore[attr-defined]
        handlers[op] = gated


def _tls(server: Any, role: str) -> bool:
    security = getattr(server, "security", None)
    return bool(getattr(security, f"tls_{role}_cert", None))


def gate_scheduler(scheduler: Any) -> bool:
    """Install the gate on a scheduler that speaks TLS; False (no certificates to tell apart) otherwise."""
    if not _tls(scheduler, "scheduler"):
        return False
    guard(scheduler.handlers, SCHEDULER_OPS, {CLIENT}, "the scheduler")
    return True


def gate_worker(worker: Any) -> bool:
    """Install the gate on a worker that speaks TLS (after its GPU plugin added its handlers)."""
    if not _tls(worker, "worker"):
        return False
    guard(worker.handlers, WORKER_OPS, {CLIENT, SCHEDULER}, f"worker {worker.name}")
    return True
