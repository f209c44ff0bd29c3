"""Who may ask a TLS cluster for what: default-deny, by the role of the certificate the peer presented.

Mutual TLS keeps out every process without a certificate of the cluster's CA,
and each party presents its own: the control plane (`aisched-client`), the
scheduler (`aisched-scheduler`) and the workers and their nannies
(`aisched-cluster`). The gate wraps every op of the scheduler, each worker and
each nanny, and lets an op through only when the peer's role is on that op's
list here. An op no list names (one a later `distributed` release adds) is
refused to every certificate until someone classifies it
(tests/test_gate.py enumerates the live handler tables against these lists).

Streams too: the messages that arrive on a worker's batched stream to the
scheduler are checked against what a worker sends (its own task results,
keep-alives, its own events), never a client's ops (`update-graph` would
submit tasks), a message naming another worker, or an event on a topic the
scheduler and its plugins trust (`all`: a forged `remove-worker`). A worker
accepts stream messages only on the connection it opened to the scheduler,
from the scheduler's certificate.

A worker's certificate keeps exactly what a worker needs: registering itself,
heartbeats, its task results and events, finding where a dependency lives,
redeeming its ticket and meeting its gang; and, at its own nanny, saying it is
closing. Nothing that runs code (`feed`, `run_function`, `broadcast`, `run`,
plugins), reads other tasks (`get_cluster_state`, `dump_cluster_state_to_url`,
`get_runspec`, `get_data`) or changes others (`terminate`, `retire_workers`,
`unregister`, `set_resources`). Plain TCP (`--no-tls`) has no certificates to
tell apart, and no gate.

    >>> peer_name({"peercert": {"subject": ((("commonName", "aisched-client"),),)}})
    'aisched-client'
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

from distributed.core import _expects_comm

CLIENT, SCHEDULER, CLUSTER = "aisched-client", "aisched-scheduler", "aisched-cluster"
PLANE = frozenset({CLIENT})
DENIED: frozenset[str] = frozenset()  # known, and refused to every certificate
FROM_SCHEDULER = frozenset({CLIENT, SCHEDULER})
WORKER = frozenset({CLUSTER})
PLANE_OR_WORKER = frozenset({CLIENT, CLUSTER})

logger = logging.getLogger("distributed.dask_gpu.gate")


def _table(default: frozenset[str], ops: str, **special: frozenset[str]) -> dict[str, frozenset[str]]:
    table = {op: default for op in ops.split()}
    table.update({op.replace("__", "-"): roles for op, roles in special.items()})
    return table


# The scheduler's request handlers. Everything is the control plane's, but for what a worker (or nanny) needs.
SCHEDULER_OPS: dict[str, frozenset[str]] = _table(PLANE, """
    adaptive_target add_keys amm_handler benchmark_hardware broadcast call_stack check_idle dump_cluster_state_to_url
    dump_state echo event_clear event_is_set event_set event_wait events gather get_cluster_state get_error_cause
    get_logs get_metadata get_runspec get_story get_task_prefix_states get_task_status get_task_stream
    get_task_stream_index gpu_limit_acquire gpu_limit_cancel gpu_limit_release gpu_limit_status gpu_queue_leave
    gpu_queue_place gpu_queue_run gpu_queue_metrics gpu_queue_status gpu_task_states gpu_ticket_where gpu_workers_left
    has_what
    identity log_event logs
    memory_sampler_start memory_sampler_stop multi_lock_acquire multi_lock_release nbytes ncores ncores_running
    performance_report processing profile proxy publish_delete publish_get publish_list publish_put queue_create
    queue_get queue_put queue_qsize rebalance register-client register_nanny_plugin register_scheduler_plugin
    register_worker_plugin replicate restart restart_workers retire_workers retry run_function scatter
    semaphore_acquire semaphore_close semaphore_refresh_leases semaphore_register semaphore_release semaphore_value
    set_metadata set_resources set_restrictions shuffle_barrier shuffle_get shuffle_get_or_create
    shuffle_restrict_task start_task_metadata stop_task_metadata subscribe_worker_status terminate unregister
    unregister_nanny_plugin unregister_scheduler_plugin unregister_worker_plugin update_data variable_get variable_set
    versions worker_logs workers_to_close
""", register__worker=WORKER, heartbeat_worker=WORKER, register_nanny=WORKER, who_has=PLANE_OR_WORKER,
    gpu_ticket_redeem=WORKER, gpu_gang_meet=WORKER,
    feed=DENIED, connection_stream=DENIED)  # feed unpickles and runs a function; nothing here opens raw streams

# What a worker sends on its batched stream to the scheduler (Scheduler.worker_handlers, work stealing).
SCHEDULER_WORKER_STREAM = frozenset("""
    task-finished task-erred release-worker-data add-keys long-running reschedule keep-alive log-event
    worker-status-change request-refresh-who-has steal-response gpu-queue-freed gpu-queue-cold
""".split())
# What the control plane sends on its client stream (Scheduler.client_handlers, the extensions', the plugins').
SCHEDULER_CLIENT_STREAM = frozenset("""
    update-graph client-desires-keys update-data report-key client-releases-keys heartbeat-client close-client
    subscribe-topic unsubscribe-topic cancel-keys publish_flush_batched_send queue-future-release queue_release
    variable-future-received-confirm variable_delete gpu-limit-release gpu-queue-leave gpu-queue-enter
""".split())
# Event topics the scheduler and its plugins act on: a worker may not log to them (a forged `remove-worker`).
PROTECTED_TOPICS = frozenset({"all", "scheduler", "aisched-worker-died"})

# A worker's request handlers: the scheduler (relaying the control plane's broadcasts) and the control plane.
WORKER_OPS: dict[str, frozenset[str]] = _table(FROM_SCHEDULER, """
    actor_attribute actor_execute benchmark_disk benchmark_memory benchmark_network call_stack dump_state echo
    free_keys gather get_data get_logs get_monitor_info get_story gpu_end_warm gpu_inventory gpu_renew gpu_running_for
    gpu_stop
    identity keys ping plugin-add plugin-remove profile profile_metadata run run_coroutine shuffle_inputs_done
    shuffle_receive terminate update_data upload_file versions
""", connection_stream=DENIED,  # worker-to-worker streams (p2p shuffles) are not used here
    gpu_run=PLANE)  # a run the queue placed, handed over with its ticket (dask_gpu.worker.sandbox)
# What a worker accepts on its stream from the scheduler.
WORKER_STREAM = frozenset("""
    acquire-replicas cancel-compute close compute-task free-keys refresh-who-has remove-replicas remove-worker
    shuffle-fail steal-request worker-status-change
""".split())

# A nanny's handlers: the scheduler (restarts, broadcasts to nannies, nanny plugins); its worker says it closes.
NANNY_OPS: dict[str, frozenset[str]] = _table(FROM_SCHEDULER, """
    dump_state echo get_logs identity instantiate kill plugin_add plugin_remove restart run terminate
""", close_gracefully=frozenset({CLIENT, SCHEDULER, CLUSTER}), connection_stream=DENIED)

TABLES: dict[str, tuple[Mapping[str, frozenset[str]], frozenset[str]]] = {
    # server kind -> (request handlers, stream ops)
    "scheduler": (SCHEDULER_OPS, SCHEDULER_WORKER_STREAM | SCHEDULER_CLIENT_STREAM),
    "worker": (WORKER_OPS, WORKER_STREAM),
    "nanny": (NANNY_OPS, frozenset()),
}


class GateRefused(PermissionError):
    """A peer asked for an op its certificate's role may not ask for (PermissionError: Dask's rpc re-raises it)."""


def peer_name(extra_info: dict[str, Any] | None) -> str | None:
    """The common name of the certificate the other end of a TLS comm presented (None: no certificate)."""
    cert = (extra_info or {}).get("peercert") or {}
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


def _refusal(where: str, op: str, name: str | None, allowed: frozenset[str] | None) -> str:
    who = name or "no certificate"
    if allowed is None:
        return (f"{where} refuses {op!r} from {who}: the gate does not know this op, so every certificate is refused "
                "it. Fix: classify it in dask_gpu.gate (which role may ask for it)")
    if not allowed:
        return f"{where} refuses {op!r} from {who}: no certificate may ask for it here"
    return f"{where} refuses {op!r} from a peer presenting {who}: only {' or '.join(sorted(allowed))} may ask for it"


def _wrap(handler: Any, op: str, table: Mapping[str, frozenset[str]], where: str) -> Any:
    if getattr(handler, "_gated", False):
        return handler
    expects = _expects_comm(handler)

    async def gated(comm: Any, **msg: Any) -> Any:
        name = peer_name(getattr(comm, "extra_info", None))
        allowed = table.get(op)
        if allowed is None or name not in allowed:
            logger.warning("%s", _refusal(where, op, name, allowed))
            raise GateRefused(_refusal(where, op, name, allowed))
        out = handler(comm, **msg) if expects else handler(**msg)
        if inspect.isawaitable(out):
            out = await out
        return out

    gated._gated = True  # type: ignore[attr-defined]
    gated.__name__ = getattr(handler, "__name__", op)
    return gated


class GatedHandlers(dict):
    """A server's handler table that gates every op put in it, now or later (a plugin adding its handlers)."""

    def __init__(self, handlers: Mapping[str, Any], table: Mapping[str, frozenset[str]], where: str) -> None:
        super().__init__()
        self.table, self.where = table, where
        self.update(handlers)

    def __setitem__(self, op: str, handler: Any) -> None:
        super().__setitem__(op, _wrap(handler, op, self.table, self.where))

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        for op, handler in dict(*args, **kwargs).items():
            self[op] = handler

    def setdefault(self, op: str, handler: Any = None) -> Any:  # type: ignore[override]
        if op not in self:
            self[op] = handler
        return self[op]


class _CheckedStream:
    """A stream comm whose messages are checked before the server's handle_stream sees them."""

    def __init__(self, comm: Any, check: Any) -> None:
        self._comm, self._check = comm, check

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    async def read(self, *args: Any, **kwargs: Any) -> Any:
        msgs = await self._comm.read(*args, **kwargs)
        if not isinstance(msgs, (tuple, list)):
            msgs = [msgs]
        return [m for m in msgs if not isinstance(m, dict) or self._check(m)]


def _stream_check(where: str, allowed: frozenset[str], worker: str | None, known_workers: Any) -> Any:
    def check(msg: dict[str, Any]) -> bool:
        op = msg.get("op")
        why = None
        if op == "close-stream" or op is None:
            return True
        if op not in allowed:
            why = "it is not a message this stream carries"
        elif worker is not None and "worker" in msg and msg["worker"] != worker:
            why = f"it names worker {msg['worker']!r}, not the sender {worker!r}"
        elif op == "log-event":
            topics = msg.get("topic")
            topics = [topics] if isinstance(topics, str) else list(topics or [])
            bad = [t for t in topics if t in PROTECTED_TOPICS or (t != worker and t in known_workers())]
            if bad:
                why = f"a worker may not log to topic {bad[0]!r}"
        if why:
            logger.warning("%s drops %r from %s: %s", where, op, worker or "a stream", why)
            return False
        return True

    return check


def _tls(server: Any, role: str) -> bool:
    security = getattr(server, "security", None)
    return bool(getattr(security, f"tls_{role}_cert", None))


def gate_scheduler(scheduler: Any) -> bool:
    """Install the gate on a scheduler that speaks TLS; False (no certificates to tell apart) otherwise."""
    if not _tls(scheduler, "scheduler") or isinstance(scheduler.handlers, GatedHandlers):
        return isinstance(scheduler.handlers, GatedHandlers)
    scheduler.handlers = GatedHandlers(scheduler.handlers, SCHEDULER_OPS, "the scheduler")
    original = scheduler.handle_stream

    async def handle_stream(comm: Any, extra: dict[str, Any] | None = None) -> None:
        extra = extra or {}
        if "worker" in extra:
            name = peer_name(getattr(comm, "extra_info", None))
            allowed = SCHEDULER_WORKER_STREAM | (SCHEDULER_CLIENT_STREAM if name == CLIENT else frozenset())
            check = _stream_check("the scheduler", allowed, extra["worker"], lambda: scheduler.workers)
        elif "client" in extra:
            check = _stream_check("the scheduler", SCHEDULER_CLIENT_STREAM, None, lambda: ())
        else:
            check = _stream_check("the scheduler", frozenset(), None, lambda: ())
        return await original(_CheckedStream(comm, check), extra)

    scheduler.handle_stream = handle_stream
    return True


def gate_worker(worker: Any) -> bool:
    """Install the gate on a worker that speaks TLS; its stream takes messages from the scheduler's certificate only."""
    if not _tls(worker, "worker") or isinstance(worker.handlers, GatedHandlers):
        return isinstance(worker.handlers, GatedHandlers)
    where = f"worker {worker.name}"
    worker.handlers = GatedHandlers(worker.handlers, WORKER_OPS, where)
    original = worker.handle_stream

    async def handle_stream(comm: Any, extra: dict[str, Any] | None = None) -> None:
        name = peer_name(getattr(comm, "extra_info", None))
        allowed = WORKER_STREAM if name == SCHEDULER else frozenset()
        return await original(_CheckedStream(comm, _stream_check(where, allowed, None, lambda: ())), extra)

    worker.handle_stream = handle_stream
    return True


def gate_nanny(nanny: Any) -> bool:
    """Install the gate on a nanny that speaks TLS (its `run` executes code just as a worker's does)."""
    if not _tls(nanny, "worker") or isinstance(nanny.handlers, GatedHandlers):
        return isinstance(nanny.handlers, GatedHandlers)
    nanny.handlers = GatedHandlers(nanny.handlers, NANNY_OPS, f"nanny {nanny.address_safe}")
    return True
