"""A body's life on this worker, as one pass of numbered steps over its case.

`dask_gpu.worker.sandbox.run_ticketed`, the one Dask task function of admitted work, calls them in this order, as
the control plane's admission runs its phases (aisched_prefect.control.admission.pipeline); each step is a function
of the run's case (`Life`), which it fills in:

1. `redeem`: the ticket verified against the keys this worker trusted at start-up and the exact bytes it got, its
   tenant against this worker's isolation (a worker that does not isolate refuses, before redeeming, a ticket of a
   tenant it does not serve); redeemed at the scheduler's registry (once for the whole cluster; a gang once per
   member) and once on this worker; then the task secedes from the worker's thread pool: a worker's thread count
   never caps how many bodies (fractions of a GPU) run on it, its devices do.
2. `take_or_fork`: the idle warm body of the run's key that the cluster's queue chose (checked once more for its
   tenant), or a fresh body forked by its tenant's zygote (after its modules are imported, once per worker), with
   its identity (an unprivileged UID) and its network mode chosen before the fork.
3. `contain`: a fresh body's outbound network (pasta), its devices taken (the ones the cluster's queue chose, or the
   allocator's choice: disjoint devices, or fractions that fit), its cgroup, all before it reads a byte of the run;
   neither the wait for devices nor the zygote's imports count as GPU time.
4. `hold_devices`: the run's devices held under its lease for steps 5 and 6, the lease renewed, the scheduler told
   which devices it took (an event, no round trip), so a worker's death names the devices it took with it.
5. `meet_the_gang`: a multi-host run's members meet at the registry once each holds its devices, and learn where
   member 0 listens (the rendezvous environment: dask_gpu.body.gang).
6. `run`: the run sent to the body with `CUDA_VISIBLE_DEVICES` set, its result awaited; the body killed (with what it
   started) when asked to stop, or when its lease is not renewed in time (the control plane is gone: fail closed),
   or signalled at its time limit; and it says why.
7. `keep_warm_or_end`: a body whose run ended well, whose key asks and whose queue entry can find it again is parked
   warm for the next run of its key; any other ends.
8. `free`: the cluster's queue told at once that the run's devices are free (the next run may start while this
   one's result is still on its way); `run_ticketed` then returns the outcome.

Steps 7 and 8 run however steps 4 to 6 end. The body and its result stay bytes here: the worker never unpickles
what a flow sent; a large result stays on the worker (dask_gpu.worker.results).
"""

from __future__ import annotations

import heapq
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from distributed import get_worker
from distributed.comm import get_address_host
from distributed.utils import sync
from distributed.worker import thread_state

from dask_gpu.body.child import WORKER_ENV, WORKER_NAME_ENV
from dask_gpu.body.gang import free_port, members_env
from dask_gpu.body.time_stop import STOPPED, signal_body
from dask_gpu.errors import DaskGPUError, DeviceUnavailable, MessageRefused, MessageTooLarge
from dask_gpu.framing import recv_msg, recv_sealed, send_msg, wait_readable
from dask_gpu.isolation import network
from dask_gpu.request import GPURequest
from dask_gpu.tickets import MEET_OP, PLACED_TOPIC, REDEEM_OP, Ticket, TicketRejected, digest, verify_signature
from dask_gpu.worker import execute
from dask_gpu.worker.bodies import BodyProcess
from dask_gpu.worker.execute import DEVICE_WAIT_SECONDS, DeviceLease, gpu_env
from dask_gpu.worker.plugin import PLUGIN_NAME, WARM_HOLD, GPUWorkerPlugin
from dask_gpu.worker.records import Body
from dask_gpu.worker.results import Held
from dask_gpu.worker.zygote import kill_group

POLL_SECONDS = 0.1
GANG_MEET_SECONDS = 120.0  # how long a gang member holding its devices waits for the others


@dataclass
class Life:
    """One run's case on this worker: what it came with, and what each step found or decided."""

    worker: Any
    plugin: GPUWorkerPlugin
    ticket: Ticket
    body: Body
    key: str  # the Dask task's key: the name its devices, lease and stop are held under
    request: GPURequest  # this member's share of the ticket's request
    proc: BodyProcess | None = None  # the body process (step 2)
    start: str = "cold"  # "cold": forked for this run; "warm": a warm body of the same key
    idle_before: float = 0.0  # a warm start: how long the body waited idle for this run
    lease: DeviceLease | None = None  # the devices held for the run (step 4)
    rendezvous: dict[str, str] = field(default_factory=dict)  # the gang's environment (step 5)
    result: dict[str, Any] = field(default_factory=dict)  # how the run ended (steps 5, 6)
    network: str | None = None  # a fresh body's network mode, chosen before its fork (step 2)
    kept: bool = False  # kept warm after the run (step 7)


# -- 1. redeem the ticket

def redeem(ticket: Ticket | None, body: Body, key: str | None = None) -> Life:
    """Step 1: no ticket, no run; a ticket runs once, here and in the whole cluster. `key`: what its devices, lease
    and stop are held under (default: its Dask task's key)."""
    worker, plugin = _plugin()
    verify_signature(ticket, plugin.trusted_keys)
    assert ticket is not None
    if digest(body.payload) != ticket.payload_digest:
        raise TicketRejected(f"ticket for run {ticket.run} was issued for other bytes than these: altered")
    if plugin.tenants is None:  # its isolation was never decided (a setup that failed): it runs nobody's body
        raise TicketRejected(f"worker {worker.address} has no isolation plan (its GPU plugin's setup failed): it runs "
                             "no body; see the worker's log")
    plugin.tenants.admit(ticket.tenant, ticket.run)  # an unisolated worker serves one tenant: refused before redeeming
    key = str(key or getattr(thread_state, "key", None) or ticket.id)
    _redeem(worker, ticket, body.member, key)  # cluster-wide (a re-run elsewhere is refused, and listed)
    ticket.check_worker(worker.address, body.member, str(worker.name or ""))  # neither rests on the scheduler's memory
    _redeem_here(plugin, ticket, body.member)
    request = ticket.member_request(body.member)
    _secede()
    return Life(worker=worker, plugin=plugin, ticket=ticket, body=body, key=key, request=request)


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


# -- 2. take a warm body or fork one

def take_or_fork(life: Life) -> None:
    """Step 2: the warm body the queue chose for this run, or a fresh one from its tenant's zygote."""
    plugin, ticket = life.plugin, life.ticket
    proc, life.idle_before = plugin.bodies.take(life.body.warm_body, ticket.warm, life.body.devices)
    if proc is None:
        life.proc = _fork(life)
        return
    life.start = "warm"
    if proc.tenant != ticket.tenant:  # the key names the tenant; checked once more, and the body ends
        plugin.bodies.end(proc, "a run of another tenant was sent to it")
        raise TicketRejected(f"run {ticket.run} of tenant {ticket.tenant!r} was sent to a warm body of tenant "
                             f"{proc.tenant!r}: refused")
    plugin.allocator.rename(proc.hold, life.key)
    proc.hold = life.key
    life.proc = proc


def _fork(life: Life) -> BodyProcess:
    """A fresh body for this run, forked by its tenant's zygote before its devices are held. On an isolated worker
    it has a UID and a network namespace of its own (unless it is a multi-host gang's member)."""
    worker, plugin, ticket = life.worker, life.plugin, life.ticket
    identity, uid = plugin.run_identity(ticket.tenant, life.request.gpus)
    settings = plugin.isolation.settings if plugin.isolation is not None else None
    if identity and settings is not None:  # its own network namespace, unless a multi-host gang's member
        identity["network"] = network.for_body(settings.network, ticket.hosts)
    try:
        sock = plugin.zygote_for(ticket.tenant).connect(life.body.modules, identity)
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
    life.network = identity.get("network")
    return proc


# -- 3. contain it

def contain(life: Life) -> None:
    """Step 3, for a fresh body (a warm one was contained when it started): its outbound network, its devices and
    its cgroup, before it reads a byte of the run. A body that cannot be set up ends."""
    if life.start != "cold":
        return
    plugin, proc, request = life.plugin, life.proc, life.request
    assert proc is not None
    settings = plugin.isolation.settings if plugin.isolation is not None else None
    try:
        if settings is not None and life.network == "pasta":  # outbound ready before it reads its run
            proc.network = network.attach(proc.pid, proc.id, settings.netns_dir, settings.pasta)
        if request.gpus:
            proc.devices = plugin.allocator.acquire(life.key, request, timeout=DEVICE_WAIT_SECONDS,
                                                    devices=life.body.devices)
            proc.hold = life.key
        plugin.contain(proc, request.gpus)  # its cgroup, before it reads a byte of the run
    except BaseException:
        plugin.bodies.end(proc, "it could not be set up")
        raise


# -- 4. hold its devices

@contextmanager
def hold_devices(life: Life) -> Iterator[None]:
    """Step 4: the run's devices held for steps 5 and 6 (a body's own, held since step 3 or since it was parked),
    its lease renewed, and the scheduler told where it was placed; its lease forgotten as the block ends."""
    plugin, ticket, body, key = life.plugin, life.ticket, life.body, life.key
    assert life.proc is not None
    with execute.hold_devices(life.request, body.devices, held=life.proc.devices, key=key) as lease:
        life.lease = lease
        plugin.renew([key], ticket.lease_seconds)
        life.worker.log_event(PLACED_TOPIC, {"ticket": ticket.id, "member": body.member, "key": key,
                                             "devices": [d.key for d in lease.devices],
                                             "host": plugin.inventory.host,
                                             "slurm_job": plugin.inventory.slurm_job})
        try:
            yield
        finally:
            plugin.forget_lease(key)


# -- 5. meet the gang

def meet_the_gang(life: Life) -> None:
    """Step 5: the rendezvous environment of this member (a gang meets at the registry first); a run stopped
    meanwhile ends here, and step 6 does not run it."""
    if not life.request.gpus:
        return
    assert life.lease is not None
    life.rendezvous, why = _meet(life.worker, life.plugin, life.key, life.ticket, life.body.member,
                                 life.lease.devices)
    if why:
        life.result = {"ok": False, "stopped": why, "error_message": f"stopped: {why}"}


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


# -- 6. run

def run(life: Life) -> None:
    """Step 6: one run in the body, unless it was stopped while its gang met."""
    if life.result:
        return
    assert life.lease is not None and life.proc is not None
    life.result = _run_child(life.plugin, life.key, life.ticket, life.body, life.lease.devices, life.worker.address,
                             life.proc, life.rendezvous)


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
        # Never more than the body may hold itself: a body past its bound is not the worker's memory to fill.
        bound = proc.cgroup.limits.memory_bytes if proc.cgroup is not None else None
        meta = json.loads(recv_msg(sock, bound))
        # A large result comes as a sealed memory file of the body's, mapped here: its bytes are not copied again.
        blob: Held = recv_sealed(sock, bound) if meta.get("sealed") else recv_msg(sock, bound)
    except MessageTooLarge as exc:
        kill_group(proc.pid)
        return {"ok": False, "died": True, "error_type": "dask_gpu.errors.MessageTooLarge",
                "error_message": f"the body's result was refused unread: {exc} (its memory bound). Fix: return less "
                                 "(write large outputs under the tenant's data path and return where they are)"}
    except MessageRefused as exc:  # the body's code handed over something else: it is not trusted with more
        kill_group(proc.pid)
        return {"ok": False, "died": True, "error_type": "dask_gpu.errors.MessageRefused",
                "error_message": f"the body's result was refused: {exc}. Fix: return the value from the task "
                                 "function; a body does not write to its worker's socket itself"}
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
        return {"ok": True, "value": b"" if kept else bytes(blob), "result": kept, **common}
    return {"ok": False, "error": bytes(blob), "error_type": meta.get("error_type", ""),
            "error_message": meta.get("error_message", ""), "error_text": meta.get("error_text", ""), **common,
            **({"stopped": STOPPED} if signalled else {})}


def _peak_mb(proc: BodyProcess) -> float | None:
    try:
        peak = proc.cgroup.peak_memory_bytes() if proc.cgroup is not None else None
    except OSError:
        return None
    return None if peak is None else round(peak / 2**20, 1)


# -- 7. keep it warm or end it

def keep_warm_or_end(life: Life) -> None:
    """Step 7: a body whose run ended well is parked warm for the next run of its key, if its key asks and its
    queue entry can find it again (one host, member 0); any other ends."""
    plugin, ticket, body, proc, result = life.plugin, life.ticket, life.body, life.proc, life.result
    assert proc is not None
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
    life.kept = keep


# -- 8. free its place

def free(life: Life) -> None:
    """Step 8: the cluster's queue told its devices are free now, not once the control plane has fetched the
    result (and, kept warm, which body waits there)."""
    assert life.proc is not None
    if life.body.queue_key:
        life.plugin.devices_freed(life.body.queue_key, warm=life.proc.id if life.kept else None,
                                  keep=life.ticket.keep_warm, task=life.key)
