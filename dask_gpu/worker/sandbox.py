"""The one Dask task function of admitted work: check the ticket, hold devices, run the body in its own process.

`run_ticketed` is what the control plane submits. On the worker it
1. verifies the ticket against the keys this worker trusted at start-up and the exact bytes it got,
2. redeems the ticket at the scheduler's registry (once for the whole cluster; a gang once per member),
   then secedes from the worker's thread pool: a worker's thread count never caps how many
   bodies (fractions of a GPU) run on it, its devices do,
3. holds the devices the ticket allows (the ones the cluster's queue chose, or the allocator's
   choice: disjoint devices, or fractions that fit) and tells the scheduler which (an event,
   no round trip), so a worker's death names the devices it took with it,
4. for a gang, meets the other members at the registry once each holds its devices, and learns
   where member 0 listens (the rendezvous environment: dask_gpu.body.gang),
5. runs the body in a fresh process (its tenant's zygote's child) with `CUDA_VISIBLE_DEVICES` set; on an
   isolated worker under a UID of its own, in namespaces of its own (dask_gpu.isolation); a worker that
   does not isolate refuses, before redeeming, a ticket of a tenant it does not serve,
6. kills that process (and what it started) when asked to stop, or when its lease is not
   renewed in time (the control plane is gone: fail closed), and says why.

The body and its result stay bytes here: the worker and the control plane
never unpickle what a flow sent. A large result does not even travel as the
task's value: the worker keeps it (dask_gpu.worker.results) and the outcome carries
its digest, size and a one-time reference its caller fetches it with.
"""

from __future__ import annotations

import heapq
import json
import threading
import time
from typing import Any, Literal

from distributed import get_worker
from distributed.comm import get_address_host
from distributed.utils import sync
from distributed.worker import thread_state
from pydantic import BaseModel, ConfigDict

from dask_gpu.body.child import WORKER_ENV, WORKER_NAME_ENV
from dask_gpu.worker.bodies import BodyProcess
from dask_gpu.worker.execute import DEVICE_WAIT_SECONDS, DeviceRun, gpu_env, hold_devices
from dask_gpu.worker.plugin import PLUGIN_NAME, WARM_HOLD, GPUWorkerPlugin
from dask_gpu.errors import DaskGPUError, DeviceUnavailable
from dask_gpu.body.gang import free_port, members_env
from dask_gpu.isolation import network
from dask_gpu.worker.results import ResultRef
from dask_gpu.tickets import MEET_OP, PLACED_TOPIC, REDEEM_OP, Ticket, TicketRejected, digest, verify_signature
from dask_gpu.framing import recv_msg, send_msg, wait_readable
from dask_gpu.body.time_stop import STOPPED, signal_body
from dask_gpu.worker.zygote import kill_group

POLL_SECONDS = 0.1
GANG_MEET_SECONDS = 120.0  # how long a gang member holding its devices waits for the others


class BodyInfo(BaseModel):
    """Which body process ran a run, and how: the evidence that a model was loaded once per body."""

    model_config = ConfigDict(frozen=True)

    id: str
    start: Literal["cold", "warm"]  # a fresh process, or a warm body of the same key that ran earlier runs
    runs: int = 1  # the runs this body has run, this one included
    idle_before: float = 0.0  # a warm start: how long the body waited idle for this run
    setup_seconds: float = 0.0  # how long loading the code took in this run (a cold start's import, a class's __init__)
    kept: bool = False  # it stays warm after this run, for `keep` seconds at most
    keep: float = 0.0
    peak_memory_mb: float | None = None  # its cgroup's peak memory so far (None: no cgroup)


class Outcome(BaseModel):
    """How one body ended, and where it ran. `value` and `error` are pickled bytes nobody here opens; a large value
    stays on its worker and `result` says where (then `value` is empty)."""

    model_config = ConfigDict(frozen=True)

    ok: bool
    value: bytes = b""
    result: ResultRef | None = None
    error: bytes = b""
    error_type: str = ""
    error_message: str = ""
    error_text: str = ""
    stopped: str | None = None  # why it was stopped: "stop requested", "lease expired", ...
    run: DeviceRun
    member: int = 0  # which member of a gang this was (0 for a run on one host)
    logs: list[tuple[int, str]] = []
    reports: list[dict[str, Any]] = []
    body: BodyInfo | None = None  # which body ran it (None: it never reached one)


class Body(BaseModel):
    """What the control plane sends with a ticket: the pickled call and what its child needs to start warm."""

    model_config = ConfigDict(frozen=True)

    payload: bytes
    modules: list[str] = []
    env: dict[str, str] = {}
    member: int = 0  # gang runs: which member this is (0 .. hosts-1)
    devices: list[str] | None = None  # the device keys the cluster's queue chose for it (None: the worker chooses)
    queue_key: str | None = None  # its key in the cluster's queue: told the devices are free the moment the body ends
    warm_body: str | None = None  # the idle warm body the cluster's queue chose for it (None: a body of its own)


def _plugin() -> tuple[Any, GPUWorkerPlugin]:
    worker = get_worker()
    plugin = worker.plugins.get(PLUGIN_NAME)
    if not isinstance(plugin, GPUWorkerPlugin):
        raise TicketRejected(f"worker {worker.address} is not GPU-aware: start it with `dask-gpu-worker`")
    return worker, plugin


def _redeem(worker: Any, ticket: Ticket, member: int, key: str) -> None:
    try:
        fresh = sync(worker.loop, getattr(worker.scheduler, REDEEM_OP), id=ticket.id, expires_at=ticket.expires_at,
                     member=member, hosts=ticket.hosts, worker=worker.address, key=key)
    except Exception as exc:  # no registry: refuse rather than risk a replay
        raise TicketRejected(f"the scheduler could not redeem ticket {ticket.id[:8]} ({type(exc).__name__}: {exc}); "
                             "start it with `dask-gpu-scheduler`, or let the control plane install the registry") from None
    if not fresh:
        raise TicketRejected(f"ticket {ticket.id[:8]} of run {ticket.run} was already used: a second execution "
                             f"(a replay, or Dask re-running the task after a worker died) is refused on {worker.address}")


def _redeem_here(plugin: GPUWorkerPlugin, ticket: Ticket, member: int) -> None:
    """Single use that does not rest on the scheduler's memory: this worker runs a ticket (member) once.

    The cluster-wide registry on the scheduler catches a re-run on another worker; a scheduler whose memory was
    altered could forget a redemption there, but the ticket names its worker(s) and each worker keeps its own."""
    now = time.time()
    with _REDEEMED_LOCK:  # tasks redeem in many threads at once: the check and the mark are one step
        used: dict[tuple[str, int], float] = plugin.__dict__.setdefault("_redeemed_here", {})
        by_expiry: list[tuple[float, tuple[str, int]]] = plugin.__dict__.setdefault("_redeemed_by_expiry", [])
        while by_expiry and by_expiry[0][0] < now:  # forgotten once expired (a heap: no scan of 10,000 per run)
            _, k = heapq.heappop(by_expiry)
            used.pop(k, None)
        if (ticket.id, member) in used:
            raise TicketRejected(f"ticket {ticket.id[:8]} of run {ticket.run} was already used on this worker: a "
                                 "second execution is refused")
        used[(ticket.id, member)] = ticket.expires_at
        heapq.heappush(by_expiry, (ticket.expires_at, (ticket.id, member)))


_REDEEMED_LOCK = threading.Lock()


def _secede() -> None:
    """Leave the worker's thread pool: the body waits in a process of its own, so its thread must not count."""
    if getattr(thread_state, "key", None) is not None:
        from distributed import secede

        secede()


def _meet(worker: Any, plugin: GPUWorkerPlugin, key: str, ticket: Ticket, member: int,
          devices: tuple[Any, ...]) -> tuple[dict[str, str], str | None]:
    """The rendezvous environment of this member (a gang meets at the registry first); or why it stopped meanwhile."""
    host = get_address_host(worker.address)
    if ticket.hosts <= 1:
        return members_env([("127.0.0.1", free_port("127.0.0.1"))], 0, len(devices)), None
    port = free_port(host) if member == 0 else 0
    stop = plugin.stop_event(key)
    deadline = time.monotonic() + GANG_MEET_SECONDS
    while True:
        why = "stop requested" if stop.is_set() else plugin.lease_expired(key) or plugin.abandoned(key)
        if why:
            return {}, why
        members = sync(worker.loop, getattr(worker.scheduler, MEET_OP), id=ticket.id, member=member,
                       hosts=ticket.hosts, host=host, port=port, wait=1.0)
        if members is not None:
            return members_env(members, member, len(devices)), None
        if time.monotonic() > deadline:
            raise DeviceUnavailable(f"run {ticket.run}: member {member} held its devices, but the other members of "
                                    f"its {ticket.hosts}-host job did not all start within {GANG_MEET_SECONDS:g}s")


def run_ticketed(ticket: Ticket | None, body: Body) -> Outcome:
    """Dask task body of every admitted run. No ticket, no run."""
    worker, plugin = _plugin()
    verify_signature(ticket, plugin.trusted_keys)
    assert ticket is not None
    if digest(body.payload) != ticket.payload_digest:
        raise TicketRejected(f"ticket for run {ticket.run} was issued for other bytes than these: altered")
    if plugin.tenants is None:  # its isolation was never decided (a setup that failed): it runs nobody's body
        raise TicketRejected(f"worker {worker.address} has no isolation plan (its GPU plugin's setup failed): it runs "
                             "no body; see the worker's log")
    plugin.tenants.admit(ticket.tenant, ticket.run)  # an unisolated worker serves one tenant: refused before redeeming
    key = str(getattr(thread_state, "key", None) or ticket.id)
    _redeem(worker, ticket, body.member, key)  # cluster-wide (a re-run elsewhere is refused, and listed)
    ticket.check_worker(worker.address, body.member, str(worker.name or ""))  # neither rests on the scheduler's memory
    _redeem_here(plugin, ticket, body.member)
    request = ticket.member_request(body.member)
    _secede()
    proc, idle_before = plugin.bodies.take(body.warm_body, ticket.warm, body.devices)
    start = "cold" if proc is None else "warm"
    if proc is None:
        proc = _start_body(worker, plugin, ticket, body, request, key)
    elif proc.tenant != ticket.tenant:  # the key names the tenant; checked once more, and the body ends
        plugin.bodies.end(proc, "a run of another tenant was sent to it")
        raise TicketRejected(f"run {ticket.run} of tenant {ticket.tenant!r} was sent to a warm body of tenant "
                             f"{proc.tenant!r}: refused")
    else:
        plugin.allocator.rename(proc.hold, key)
        proc.hold = key
    result: dict[str, Any] = {}
    try:
        with hold_devices(request, body.devices, held=proc.devices) as lease:
            plugin.renew([key], ticket.lease_seconds)
            worker.log_event(PLACED_TOPIC, {"ticket": ticket.id, "member": body.member, "key": key,
                                            "devices": [d.key for d in lease.devices],
                                            "host": plugin.inventory.host,
                                            "slurm_job": plugin.inventory.slurm_job})
            try:
                env, why = _meet(worker, plugin, key, ticket, body.member, lease.devices) if request.gpus else ({}, None)
                if why:
                    result = {"ok": False, "stopped": why, "error_message": f"stopped: {why}"}
                else:
                    result = _run_child(plugin, key, ticket, body, lease.devices, worker.address, proc, env)
            finally:
                plugin.forget_lease(key)
    finally:
        kept = _after_run(plugin, ticket, body, proc, result)
    info = BodyInfo(id=proc.id, start=start, runs=proc.runs, idle_before=idle_before, kept=kept,
                    keep=ticket.keep_warm if kept else 0.0, setup_seconds=result.pop("setup_seconds", 0.0),
                    peak_memory_mb=result.pop("peak_memory_mb", None))
    return Outcome(run=lease.run(), member=body.member, body=info, **result)


def _peak_mb(proc: BodyProcess) -> float | None:
    try:
        peak = proc.cgroup.peak_memory_bytes() if proc.cgroup is not None else None
    except OSError:
        return None
    return None if peak is None else round(peak / 2**20, 1)


def _start_body(worker: Any, plugin: GPUWorkerPlugin, ticket: Ticket, body: Body, request: Any, key: str) -> BodyProcess:
    """A fresh body for this run: forked by its tenant's zygote (after its modules are imported, once per worker)
    before its devices are held, so neither the wait for devices nor the zygote's imports count as GPU time. On an
    isolated worker it has a network namespace of its own, served by pasta where outbound is configured."""
    identity, uid = plugin.run_identity(ticket.tenant, request.gpus)
    settings = plugin.isolation.settings if plugin.isolation is not None else None
    if identity and settings is not None:  # its own network namespace, unless a multi-host gang's member
        identity["network"] = network.for_body(settings.network, ticket.hosts)
    try:
        sock = plugin.zygote_for(ticket.tenant).connect(body.modules, identity)
    except BaseException:
        plugin.release_identity(uid)
        raise
    try:
        pid = json.loads(recv_msg(sock))["pid"]
    except (EOFError, OSError, ValueError, KeyError):
        sock.close()
        plugin.release_identity(uid)
        raise DaskGPUError(f"run {ticket.run}: the zygote of tenant {ticket.tenant or '(none)'} on worker "
                           f"{worker.address} ended before it started the body (isolation: "
                           f"{plugin.isolation.mode if plugin.isolation else '?'}); see the worker's log") from None
    proc = BodyProcess(tenant=ticket.tenant, key=ticket.warm, sock=sock, pid=pid, uid=uid,
                       workdir=plugin.workdir_of(identity))
    plugin.bodies.add(proc)
    try:
        if settings is not None and identity.get("network") == "pasta":  # outbound ready before it reads its run
            proc.network = network.attach(proc.pid, proc.id, settings.netns_dir, settings.pasta)
        if request.gpus:
            proc.devices = plugin.allocator.acquire(key, request, timeout=DEVICE_WAIT_SECONDS, devices=body.devices)
            proc.hold = key
        plugin.contain(proc, request.gpus)  # its cgroup, before it reads a byte of the run
    except BaseException:
        plugin.bodies.end(proc, "it could not be set up")
        raise
    return proc


def _after_run(plugin: GPUWorkerPlugin, ticket: Ticket, body: Body, proc: BodyProcess, result: dict[str, Any]) -> bool:
    """Keep the body warm for the next run of its key, or end it; tell the cluster's queue its place is free."""
    alive = bool(result) and not result.get("stopped") and not result.get("died")
    result.pop("died", None)
    keep = (alive and ticket.keep_warm > 0 and bool(ticket.warm) and bool(body.queue_key) and ticket.hosts <= 1
            and not body.member)
    if keep:
        warm_hold = f"{WARM_HOLD}{proc.id}"
        plugin.allocator.rename(proc.hold, warm_hold)
        proc.hold = warm_hold
        keep = plugin.bodies.park(proc, ticket.keep_warm)
    if not keep:
        plugin.bodies.end(proc, "its run was stopped" if result.get("stopped") else "its run ended")
    if body.queue_key:  # the next run may have these devices now, not once the control plane has fetched this result
        plugin.devices_freed(body.queue_key, warm=proc.id if keep else None, keep=ticket.keep_warm)
    return keep


def _run_child(plugin: GPUWorkerPlugin, key: str, ticket: Ticket, body: Body, devices: tuple[Any, ...],
               address: str, proc: BodyProcess, rendezvous: dict[str, str]) -> dict[str, Any]:
    """One run in `proc`: send it, wait for its result (or stop it: the body is then killed with what it started)."""
    stop, soft, signalled = plugin.stop_event(key), plugin.soft_stop_event(key), False
    env = {**body.env, **rendezvous, WORKER_ENV: address, WORKER_NAME_ENV: plugin.worker_name}
    if devices:
        env.update({k: v for k, v in gpu_env(devices, base={}).items()})
    sock = proc.sock
    proc.runs += 1
    try:
        send_msg(sock, json.dumps({"env": env, "code_digest": ticket.code_digest,
                                   "devices": [d.model_dump() for d in devices]}).encode())
        send_msg(sock, body.payload)
        while not wait_readable(sock, POLL_SECONDS):
            why = "stop requested" if stop.is_set() else plugin.lease_expired(key) or plugin.abandoned(key)
            if why:
                kill_group(proc.pid)
                return {"ok": False, "stopped": why, "error_message": f"stopped: {why}"}
            if soft.is_set() and not signalled:  # its time limit: SIGTERM, its checkpoint() raises (time_stop)
                signalled = signal_body(proc.pid)
        meta = json.loads(recv_msg(sock))
        blob = recv_msg(sock)
    except (EOFError, OSError, ValueError):
        why = "stop requested" if stop.is_set() else plugin.lease_expired(key)
        if why:
            return {"ok": False, "stopped": why, "error_message": f"stopped: {why}"}
        if proc.cgroup is not None and proc.cgroup.oom_killed():
            from dask_gpu.isolation.cgroups import OOM_REASON

            limit = proc.cgroup.limits.memory_bytes or 0
            return {"ok": False, "died": True, "error_type": f"dask_gpu.{OOM_REASON}",
                    "error_message": f"{OOM_REASON}: the body passed its memory limit ({limit / 2**30:.1f} GiB) and "
                                     "was killed. Fix: ask for more (a larger GPU share), or have the operator raise "
                                     "dask-gpu.isolation.body-memory-gb"}
        return {"ok": False, "died": True, "error_type": "builtins.SystemExit",
                "error_message": "the task's process died without a result (killed, or it called os._exit)"}
    common = {"logs": meta.get("logs", []), "reports": meta.get("reports", []),
              "setup_seconds": float(meta.get("setup_seconds") or 0.0), "peak_memory_mb": _peak_mb(proc)}
    if meta["ok"]:
        # Member 0's value is the run's (a gang's other values are dropped by the plane): only it may stay here.
        kept = plugin.results.hold(blob, ticket.expires_at - ticket.issued_at) if plugin.results and not body.member \
            else None
        return {"ok": True, "value": b"" if kept else blob, "result": kept, **common}
    return {"ok": False, "error": blob, "error_type": meta.get("error_type", ""),
            "error_message": meta.get("error_message", ""), "error_text": meta.get("error_text", ""), **common,
            **({"stopped": STOPPED} if signalled else {})}
