"""The control plane's link to the Dask scheduler: connecting, installing what the plane needs there, keeping it.

The control plane is the cluster's only client (it alone holds the client certificate). Connecting
starts a local cluster when no scheduler is named; installing puts the ticket registry, the per-model
limits and the queue (with the tenant weights of the applied ClusterBlocks) on the scheduler. The link
notices a lost scheduler and a regained one (maybe a fresh process) and installs all of it again, and
it shows the cluster and its queue to operators.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import types
from concurrent.futures import Future
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dask_gpu import LocalGPUCluster
from dask_gpu.scheduler.limits import install_limits
from dask_gpu.security import ClusterTLS
from dask_gpu.tickets import install_registry

if TYPE_CHECKING:  # names only: the server imports this module first, to start the local cluster before the rest
    from aisched_prefect.control.authority.state import AuthorityState
    from aisched_prefect.control.dispatch.dispatcher import Dispatcher
    from aisched_prefect.settings import Settings

logger = logging.getLogger("aisched_prefect.control")

ATTEMPT_SECONDS = 3.0  # one reconnect attempt: Dask's own backoff inside it stays under this
RETRY_PAUSE_SECONDS = 0.5  # between attempts, however long the scheduler has been gone


def connect(settings: Settings, stack: ExitStack, *, dask_address: str | None, declared: str | None,
            dask_tls: Path | None, trusted_key: str) -> tuple[Any, LocalGPUCluster | None]:
    """The plane's Dask client (and the local cluster it started when no `dask_address` is named), each closed by
    `stack`; workers of a local cluster trust `trusted_key` only."""
    from distributed import Client

    cluster: LocalGPUCluster | None = None
    # Only the control plane holds the cluster's client certificate: no other process can connect.
    tls = ClusterTLS.load_or_create(dask_tls or settings.home / "tls") if dask_tls or not dask_address else None
    if dask_address:
        security = tls.security("client") if tls is not None else None
        client = Client(dask_address, set_as_default=False, security=security)
    else:
        assert tls is not None
        # Its scheduler in a process of its own: a busy .map() must not starve the plane's client's loop.
        cluster = LocalGPUCluster(declared=declared, trusted_keys=[trusted_key], tls=tls, scheduler_process=True)
        stack.callback(cluster.close)
        client = Client(cluster.scheduler_address, set_as_default=False, security=tls.security("client"))
    stack.callback(client.close)
    # Dask's client reconnects for `timeout` (30 s) and then closes for good; the plane keeps trying.
    client._timeout = settings.scheduler_reconnect_seconds
    client._reconnect = types.MethodType(reconnect_promptly, client)  # type: ignore[method-assign]
    return client, cluster


class EarlyCluster:
    """The local cluster `connect` starts, begun on a thread of its own before the plane imports the rest of itself:
    its scheduler's and workers' processes start (seconds of imports each) while the plane's own imports run, not
    after them. `take` hands the client and cluster to the plane, with what closes them."""

    def __init__(self, settings: Settings, *, declared: str | None, dask_tls: Path | None, trusted_key: str) -> None:
        self.trusted_key = trusted_key
        self._stack = ExitStack()
        self._result: Future = Future()
        threading.Thread(target=self._start, args=(settings, declared, dask_tls), name="aisched-cluster-start",
                         daemon=True).start()

    def _start(self, settings: Settings, declared: str | None, dask_tls: Path | None) -> None:
        try:
            self._result.set_result(connect(settings, self._stack, dask_address=None, declared=declared,
                                            dask_tls=dask_tls, trusted_key=self.trusted_key))
        except BaseException as exc:  # raised where the plane takes it
            self._stack.close()
            self._result.set_exception(exc)

    def take(self, stack: ExitStack, trusted_key: str) -> tuple[Any, LocalGPUCluster | None]:
        """The client and its cluster, closed by `stack`; its workers trust `trusted_key` (the plane's) or this
        raises."""
        if trusted_key != self.trusted_key:
            self.close()
            raise ValueError("the local cluster was started trusting another key than this control plane's")
        client, cluster = self._result.result()
        stack.push(self._stack)
        return client, cluster

    def close(self) -> None:
        """Not taken (the plane failed to start): its cluster stops."""
        try:
            self._result.result()
        except BaseException:
            return
        self._stack.close()


async def reconnect_promptly(client: Any) -> None:
    """Dask's `Client._reconnect`, in attempts of ATTEMPT_SECONDS with a fixed pause between them, for as long as
    `client._timeout` (AISCHED_SCHEDULER_RECONNECT_SECONDS).

    Why: Dask's own makes one connect call for the whole timeout, whose backoff doubles with no cap but the time
    left; with the plane's 7 days that let it sleep 14-44 s (growing with the outage) after the scheduler was back,
    and /v1/health said 503 all that while. Here a regained scheduler is reached within about ATTEMPT_SECONDS."""
    client.status = "connecting"
    client.scheduler_comm = None
    for st in client.futures.values():  # as Dask's own: what the lost scheduler ran is gone with it
        st.cancel(reason="scheduler-connection-lost",
                  msg="Client lost the connection to the scheduler. Please check your connection and re-run your work.")
    client.futures.clear()
    deadline = time.time() + client._timeout
    while client.status == "connecting" and time.time() < deadline:
        try:
            await client._ensure_connected(timeout=min(ATTEMPT_SECONDS, max(deadline - time.time(), 0.1)))
            return
        except OSError:
            await asyncio.sleep(RETRY_PAUSE_SECONDS)
        except ImportError:
            await client._close()
            return
    if client.status == "connecting":
        logger.error("could not reach the Dask scheduler again for %.0fs (AISCHED_SCHEDULER_RECONNECT_SECONDS): "
                     "closing the plane's Dask client", client._timeout)
        await client._close()


def tenant_weights(state: AuthorityState) -> dict[str, float]:
    """The queue's tenant weights: every applied ClusterBlock's `tenant_weights`, the latest applied winning
    where two name the same tenant (a tenant none names weighs 1)."""
    out: dict[str, float] = {}
    clusters = [a for (k, _), a in state.snapshot.configs.items() if k == "cluster"]
    for applied in sorted(clusters, key=lambda a: a.seq):
        out.update(applied.model.tenant_weights)
    return out


def install(client: Any, state: AuthorityState, *, queue: bool) -> None:
    """What the plane needs on a scheduler it first reaches: the ticket registry, the per-model call limits and
    (with `queue`) the cluster's one queue, with the tenant weights applied now."""
    install_registry(client)
    install_limits(client)  # per-model call limits, where the queue lives
    if queue:
        from dask_gpu import install_queue

        install_queue(client, weights=tenant_weights(state))


class SchedulerLink:
    """Keeps the scheduler set up for the plane: the queue's weights, a lost and regained scheduler, and the
    views of the cluster and its queue."""

    def __init__(self, client: Any, dispatcher: Dispatcher, state: AuthorityState, *, queue: bool) -> None:
        self.client, self.dispatcher, self.state, self.queue = client, dispatcher, state, queue
        self.address: str = client.scheduler.address
        self._lost_at: float | None = None  # when the Dask scheduler stopped answering (None: it answers)
        self._weights_lock = threading.Lock()  # an apply and the periodic sync set the queue's weights in turn

    def status(self) -> dict[str, Any]:
        """Whether the Dask scheduler answers now, and since when it has not (for /v1/health and doctor)."""
        running = self.client.status == "running" and self.client.scheduler is not None
        return {"connected": running, "address": self.address,
                **({} if running or self._lost_at is None else {"lost_for_seconds": round(time.time() - self._lost_at, 1)})}

    def watch(self) -> None:
        """Notice a lost and a regained scheduler: a regained one (maybe a fresh process) gets the registry, the
        limits, the queue and its weights again, and every run that waited in the old queue is queued again."""
        running = self.client.status == "running"
        if not running:
            if self._lost_at is None:
                self._lost_at = time.time()
                logger.error("lost the Dask scheduler at %s: reconnecting (runs on it fail with SchedulerLost; "
                             "waiting runs are queued again once it is back)", self.address)
            return
        if self._lost_at is None:
            return
        logger.warning("the Dask scheduler at %s is back after %.0fs: installing the queue again and re-queueing "
                       "%d waiting run(s)", self.address, time.time() - self._lost_at, self.dispatcher.waiting())
        try:
            install_registry(self.client)
            install_limits(self.client)
            if self.queue:
                self.set_queue_weights()
            self.dispatcher.resubscribe()
            self.dispatcher.reenter_waiting()
            self._lost_at = None
        except Exception:  # tried again at the next chore
            logger.exception("could not set the scheduler up again; retrying")

    def set_queue_weights(self) -> None:
        """Send the applied tenant weights to the cluster's queue (after a ClusterBlock's apply, and periodically:
        a scheduler that restarted, its queue installed afresh by its preload, gets them back)."""
        if not self.queue:
            return
        from dask_gpu import install_queue

        try:
            with self._weights_lock:  # read and sent together: a sync that read before an apply cannot land after it
                install_queue(self.client, weights=tenant_weights(self.state))
        except Exception:
            logger.exception("could not set the tenant weights on the cluster's queue")

    def cluster_view(self) -> dict[str, Any]:
        """Workers, their devices and holders, with each holder named by its run (task, principal, tenant)."""
        from dask_gpu import cluster_view

        with self.dispatcher.lock:  # a gang's members are each a Dask key of their own: each names the run
            runs = {dk: {"task": r.admission.task_name, "principal": r.admission.principal, "tenant": r.admission.tenant,
                         "task_run_id": r.admission.task_run_id, **({"member": i} if r.members else {})}
                    for r in self.dispatcher.running.values() for i, dk in enumerate(r.dask_keys)}
        workers = []
        for w in cluster_view(self.client):
            workers.append({**w.model_dump(mode="json"), "free": w.free(),
                            "runs": {k: {**runs.get(k, {"task": k}), "devices": devs} for k, devs in w.held.items()}})
        return {"dask": self.client.scheduler.address, "workers": workers}

    def queue_view(self) -> Any:
        """The cluster's queue (runs on GPUs, then waiting runs in serving order), or None without one (`aisched
        serve --no-queue`: runs go to Dask directly, whatever the scheduler carries)."""
        if not self.queue:
            return None
        return self.client.sync(self.client.scheduler.gpu_queue_status, runs=True)
