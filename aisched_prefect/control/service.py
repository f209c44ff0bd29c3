"""The control plane: the one process that holds authority, money and evidence, and the only Dask client.

`ControlPlane` only wires it together. It builds, in one ExitStack, the shared pieces: the ledger
(its database credentials), the signing key (tickets and checkpoints), the folded authority state,
the Dask client (and the local cluster when it starts one), the dispatcher, the admission pipeline,
the approval, call and outcome books, and the watcher with its chores. The acts are its parts', each a
module of its own, every act taking the caller's proven credential:

- `credentials` (credentials.py): proving callers; issuing and revoking credentials.
- `configuration` (configuration.py): applying blocks, and blocks edited in Prefect past them.
- `grants` (grants.py): delegating and revoking grants.
- `runs` (runs.py): a flow's AI task calls, claimed, admitted (one pass of `pipeline`), started, their
  replies filed.
- `pipeline` (pipeline.py): admission, its phases in order over one snapshot (phases.py); approved calls
  and preempted runs re-enter it.
- `desk` (approval_desk.py): people's side of approvals: requests shown, answers counted.
- `reports` (reports.py): signed checkpoints, usage artifacts, a flow run's records.
- `scheduler` (scheduler_link.py): the Dask scheduler set up, watched, and shown.

The HTTP app (app.py) is a thin shell that calls the part owning each act.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path

from aisched_prefect.control.approvals.desk import ApprovalDesk
from aisched_prefect.control.approvals.waiters import Waiters
from aisched_prefect.control.approvals.requests import ApprovalBook
from aisched_prefect.control.calls import TOKEN_PURPOSE, CallBook, TokenSeal
from aisched_prefect.control.authority.configuration import Configuration
from aisched_prefect.control.authority.credentials import Credentials
from aisched_prefect.control.dispatch.dispatcher import Dispatcher
from aisched_prefect.control.authority.grants import Grants
from aisched_prefect.control.authority.keys import derived_secret, load_or_make_key, write_private  # noqa: F401 - where callers look
from aisched_prefect.control.outcomes import OutcomeBook
from aisched_prefect.control.admission.pipeline import Pipeline
from aisched_prefect.control.reports import Reports
from aisched_prefect.control.runs import Runs, abandon_waiting
from aisched_prefect.control.dispatch.scheduler_link import EarlyCluster, SchedulerLink, connect, install
from aisched_prefect.control.dispatch.settlement import emit_budget_alert
from aisched_prefect.control.authority.state import AuthorityState
from aisched_prefect.control.dispatch.watcher import Watcher
from aisched_prefect.ledger import Ledger
from aisched_prefect.settings import Settings
from dask_gpu.tickets import TicketSigner

logger = logging.getLogger("aisched_prefect.control")


class ControlPlane:
    """Admission, dispatch, settlement, approvals, authority and evidence for every flow that calls it: the shared
    pieces and the parts that act on them, built together and closed together."""

    def __init__(self, settings: Settings, *, dask_address: str | None = None, declared: str | None = None,
                 queue: bool = True, base_url: str = "", checkpoint_dir: Path | None = None,
                 key_path: Path | None = None, replica: str | None = None, dask_tls: Path | None = None,
                 early: EarlyCluster | None = None) -> None:
        self.settings = settings
        self.base_url = base_url
        self.replica = replica or f"{os.uname().nodename}-{os.getpid()}"
        # This process's life: a restarted plane (same name: a container's pid 1) is told apart by it, so a flow
        # sends it the calls its earlier life accepted and lost with its memory.
        self.instance = uuid.uuid4().hex
        self.checkpoint_dir = checkpoint_dir
        self.queue = queue
        self._stack = ExitStack()
        try:
            self.key = load_or_make_key(key_path or settings.home / "control.key")
            self.signer = TicketSigner(self.key)
            # Every record it writes is signed: a record in its log that it did not write is told apart.
            self.ledger = Ledger(settings.ledger(), lease_seconds=settings.hold_lease_seconds, on_alert=emit_budget_alert,
                                 signer=self.signer.sign)
            self._stack.callback(self.ledger.close)
            self.state = AuthorityState(self.ledger, trusted=[self.signer.public_key])
            self.state.refresh()
            self._stack.callback(self._mark)  # as it stops, after its last records: the next plane starts there
            if early is not None:  # the local cluster the server began before importing this module
                self.client, self.cluster = early.take(self._stack, self.public_key)
            else:
                self.client, self.cluster = connect(settings, self._stack, dask_address=dask_address,
                                                    declared=declared, dask_tls=dask_tls, trusted_key=self.public_key)
            install(self.client, self.state, queue=queue)
            self.dispatcher = Dispatcher(self.client, self.signer, self.ledger, self.state, settings, queue=queue)
            self._stack.callback(self.dispatcher.warm.close)  # before the client closes: bodies end, idle time settled
            self._stack.callback(self.dispatcher.handovers.close)
            # Bodies that ended, or whose worker left, while no plane listened (this one was killed): settled now.
            threading.Thread(target=self.dispatcher.reconcile_warm, name="aisched-warm-reconcile", daemon=True).start()
            self.approvals = ApprovalBook(self.ledger, self.state, base_url)
            self.waiters = Waiters(self.approvals, settings.session_lease_seconds)
            # A completed call's result token is kept sealed under a key only the plane's key file gives.
            self.calls = CallBook(self.ledger, self.replica, base_url,
                                  seal=TokenSeal(derived_secret(self.key, TOKEN_PURPOSE)))
            self.outcomes = OutcomeBook(settings.session_lease_seconds,
                                        on_abandoned=partial(abandon_waiting, self.dispatcher),
                                        on_gone=self.dispatcher.warm.callers_gone)
            # The parts: each owns one kind of act, and takes only what it acts on.
            self.scheduler = SchedulerLink(self.client, self.dispatcher, self.state, queue=queue)
            self.credentials = Credentials(self.ledger, self.state, settings)
            self.configuration = Configuration(self.ledger, self.state, self.scheduler.set_queue_weights)
            self.grants = Grants(self.ledger, self.state)
            self.desk = ApprovalDesk(self.ledger, self.state, settings, self.approvals, self.waiters)
            self.pipeline = Pipeline(self.ledger, self.state, self.dispatcher.inventories, self.replica,
                                     approvals=self.approvals, before_asking=self.credentials.check_open_approvals,
                                     settle=self.dispatcher.settle, defers=self.dispatcher.defers)
            self.runs = Runs(settings, self.ledger, self.dispatcher, self.pipeline, self.calls, self.outcomes,
                             self.replica)
            self.reports = Reports(self.ledger, self.key, self.public_key, self.calls, checkpoint_dir)
            self._stack.callback(self.reports.close)
            self.watcher = Watcher(self.dispatcher, self.state, settings, heartbeat=self.calls.heartbeat,
                                   periodic=self._chores())
            self.watcher.start()
            self._stack.callback(self.watcher.close)
            self._stack.callback(self.runs.close)
        except BaseException:
            self._stack.close()
            raise

    def _chores(self) -> list[tuple[float, Callable[[], None]]]:
        """What the watcher runs periodically besides keeping runs honest: (every so many seconds, what)."""
        settings = self.settings
        chores: list[tuple[float, Callable[[], None]]] = [
            (settings.drift_seconds, self.configuration.record_drift),
            (min(settings.hold_lease_seconds / 3, 30.0), self.approvals.tend),  # holds of waiting requests
            (min(settings.session_lease_seconds / 3, 5.0), self.waiters.sweep),  # requests of flows that are gone
            (settings.day_report_seconds, self.reports.publish_day_report),
            (min(settings.session_lease_seconds / 3, 5.0), self.outcomes.expire),
            (2.0, self.runs.refile),  # replies of runs that ended while the database was down
            (settings.warm_reconcile_seconds, self.dispatcher.reconcile_warm),  # warm bodies that ended unheard
            (60.0, self._mark)]  # where a plane starting later begins checking the log (control.authority.marks)
        if self.checkpoint_dir is not None:
            chores.append((settings.checkpoint_seconds, self.reports.checkpoint_if_moved))
        if self.queue:  # a scheduler that restarted (its queue installed afresh by its preload) gets the weights back
            chores.append((settings.queue_sync_seconds, self.scheduler.set_queue_weights))
        chores.append((1.0, self.scheduler.watch))
        return chores

    def _mark(self) -> None:
        """An authority mark, once enough records were checked since the last (never raises: a plane without one
        checks more of the log as it starts)."""
        try:
            self.state.mark()
        except Exception as exc:  # noqa: BLE001 - the ledger is out: the next chore tries again
            logger.warning("could not write an authority mark: %s", exc)

    def close(self) -> None:
        self._stack.close()

    @property
    def public_key(self) -> str:
        return self.signer.public_key.hex()

    @property
    def version(self) -> str:
        from importlib.metadata import version

        return version("aisched-prefect")
