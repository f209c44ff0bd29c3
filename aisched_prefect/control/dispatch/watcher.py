"""The watcher: keeps running work honest while it runs, and idle warm bodies while they wait.

Every `watch_seconds` it folds new authority records (another replica's
revocation included), stops runs whose chain broke (a grant revoked, deleted
from its applied authority, expired or shortened, a delegation withdrawn),
whose credential was revoked or expired, or whose budget cover ran out with a
refused top-up; ends idle warm bodies for the same reasons, and those whose
budget was cut below what it has spent and holds; reads the idle bodies other
replicas (or this plane's earlier life) booked; renews the leases of the bodies
it still vouches for (a worker kills a body whose lease runs out: if the control
plane is gone, work stops), and renews budget holds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any
import time

from aisched_prefect.control.admission import stages
from aisched_prefect.control.admission.record import Admission
from aisched_prefect.control.dispatch.dispatcher import Dispatcher
from aisched_prefect.control.dispatch.running import Running
from aisched_prefect.control.authority.state import AuthorityState
from aisched_prefect.control.dispatch.warm import WarmIdle
from aisched_prefect.control.dispatch.time_limit import TimeLimitWatch, top_up_room
from aisched_prefect.settings import Settings
from blocks import ChainBroken, Usage
from dask_gpu import renew_leases, running_for

logger = logging.getLogger("aisched_prefect.control")
TOP_UP_AT = 0.8  # ask for a top-up when a GPU task has used this share of the time its holds cover
MAX_TOP_UPS_PER_POLL = 20  # catching up after late polls, bounded
STUCK_CHECK_SECONDS = 5.0  # how often runs handed to Dask are checked for a dead worker's no-worker state
RECHECK_SECONDS = 2.0  # how often every run's authority is walked again when nothing changed (grants expire)
WARM_LOAD_SECONDS = 2.0  # how often the idle warm bodies' rows are read (another replica's, a dead plane's)


class Watcher:
    def __init__(self, dispatcher: Dispatcher, state: AuthorityState, settings: Settings,
                 heartbeat: Callable[[], None] | None = None,
                 periodic: list[tuple[float, Callable[[], None]]] | None = None) -> None:
        self.dispatcher, self.state, self.settings = dispatcher, state, settings
        self.heartbeat = heartbeat  # this replica is alive: calls it holds are not taken over
        self.periodic = periodic or []  # slow chores (checkpoints, drift checks), on a thread of their own
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="aisched-watch", daemon=True)
        self._chores = threading.Thread(target=self._chore_loop, name="aisched-chores", daemon=True)
        self._checked_snapshot: Any = None  # stop_broken: the snapshot the runs in `_checked` were checked against
        self._checked_at = 0.0
        self._checked: set[str] = set()
        self.time_limits = TimeLimitWatch(dispatcher, settings)  # runs past est_seconds + grace: stopped (issue 42)

    def start(self) -> None:
        self._thread.start()
        if self.periodic:
            self._chores.start()

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=5)
        if self._chores.is_alive():
            self._chores.join(timeout=5)

    def _chore_loop(self) -> None:
        last = [time.monotonic()] * len(self.periodic)
        while not self._closing.wait(min(every for every, _ in self.periodic) / 2):
            for i, (every, chore) in enumerate(self.periodic):
                if time.monotonic() - last[i] >= every:
                    last[i] = time.monotonic()
                    try:
                        chore()
                    except Exception:
                        logger.exception("periodic %s failed; it runs again later", getattr(chore, "__name__", chore))

    def _loop(self) -> None:
        leases_at = holds_at = stuck_at = warm_at = 0.0
        while not self._closing.wait(self.settings.watch_seconds):
            try:
                if self.heartbeat is not None:
                    self.heartbeat()
                self.state.refresh()
                with self.dispatcher.lock:
                    running = dict(self.dispatcher.running)
                if running:
                    self.stop_broken(running)
                    self.enforce_cover(running)
                    self.time_limits.check(running)
                now = time.monotonic()
                if now - warm_at >= WARM_LOAD_SECONDS:  # idle warm bodies: every replica's, ended within a poll
                    warm_at = now
                    self._warm_with_rows()
                else:
                    self.dispatcher.warm.end_broken(self.why_broken)
                self.dispatcher.warm.end_spent()  # a carried idle period's body, before its waits outrun its hold
                if running and now - leases_at >= self.settings.body_lease_seconds / 3:
                    handed = [k for r in running.values() if r.dask_at is not None for k in r.dask_keys]
                    if handed:  # runs still waiting in the queue have no body to renew
                        renew_leases(self.dispatcher.client, handed, self.settings.body_lease_seconds)
                    leases_at = now
                if running and now - stuck_at >= STUCK_CHECK_SECONDS:  # a dead worker's runs, if its event was missed
                    self.dispatcher.check_stuck(running)
                    stuck_at = now
                if now - holds_at >= self.settings.hold_lease_seconds / 3:
                    live = [h.id for r in running.values() for h in r.holds]
                    if live:
                        lost = set(live) - self.dispatcher.ledger.renew(live)
                        if lost:
                            logger.warning("%d hold(s) were no longer pending when renewed (expired or settled)", len(lost))
                    holds_at = now
            except Exception:  # keep watching; the next poll retries
                logger.exception("watcher failed; retrying")

    def _warm_with_rows(self) -> None:
        """The idle bodies' rows read, then every idle body's authority and budget checked; while the ledger is
        unreachable, the bodies known here are still checked against authority (one line logged, not a traceback)."""
        from aisched_prefect.control.dispatch.outlast import unreachable

        try:
            self.dispatcher.warm.load()
            self.dispatcher.warm.end_broken(self.why_broken, self.budget_cut)
        except Exception as exc:
            if not unreachable(exc):
                raise
            logger.warning("the warm bodies' rows could not be read (the ledger is unreachable): %s", exc)
            self.dispatcher.warm.end_broken(self.why_broken)

    def why_broken(self, adm: Admission) -> str | None:
        """Why this admission's authority no longer stands (a run's, or a warm body's last run's), or None."""
        snap = self.state.snapshot
        cred = snap.credentials.get(adm.credential)
        if cred is None or cred.revoked:
            return f"the credential of {adm.principal!r} was revoked"
        if cred.expired(time.time()):
            return f"the credential of {adm.principal!r} expired"
        try:
            bound = stages.configuration(snap, cred)
            chain = stages.chain_of(snap, bound.authority, adm.chain[-1])
        except ChainBroken as exc:
            return str(exc)
        except Exception as exc:  # configuration gone: fail closed
            return f"{type(exc).__name__}: {exc}"
        # Still in force, but does it still cover this run? (An operator narrowed it: kinds, models, GPUs, cost.)
        return chain[-1].refusal(adm.facts)

    def budget_cut(self, periods: list[WarmIdle]) -> dict[str, str]:
        """Idle warm bodies holding on a budget account that a cut left over its limit (spent and held above it):
        their hold would be refused now, so they end (body -> why)."""
        ledger = self.dispatcher.ledger
        accounts = {(a["budget"], a["period"]): a for a in ledger.accounts()}
        limits = {row["budget"]: row["limit"] for row in ledger.limits()}
        out: dict[str, str] = {}
        for p in periods:
            for h in p.holds:
                a = accounts.get((h.budget, h.period))
                limit = limits.get(h.budget, a["limit"]) if a is not None else None
                if a is not None and limit is not None and a["posted"] + a["pending"] > limit + 1e-9:
                    out[p.body] = (f"budget {h.budget!r} was cut to {limit:g}, below what it has spent and holds "
                                   f"({a['posted'] + a['pending']:g})")
                    break
        return out

    def stop_broken(self, running: dict[str, Running]) -> None:
        """Stop runs whose authority ended. A run is checked when it is new to the watcher, when the authority
        state changed, and at least every RECHECK_SECONDS (expiry is a matter of time): thousands of waiting
        runs cost a set lookup each per poll, not a chain walk."""
        victims = {}
        snap, now = self.state.snapshot, time.monotonic()
        full = snap is not self._checked_snapshot or now - self._checked_at >= RECHECK_SECONDS
        if full:
            self._checked_snapshot, self._checked_at, self._checked = snap, now, set()
        memo: dict[tuple[str, str, Any], str | None] = {}
        for key, r in running.items():
            if r.stop_reason is None and key not in self._checked:
                self._checked.add(key)
                adm = r.admission
                k = (adm.credential, adm.chain[-1] if adm.chain else "", adm.facts)
                why = memo[k] if k in memo else memo.setdefault(k, self.why_broken(r.admission))
                if why is not None:
                    victims[key] = why
        if victims:
            self.dispatcher.stop(list(victims), "revoked")
            logger.warning("authority withdrawn: stopping %d running AI task(s): %s", len(victims),
                           "; ".join(sorted(set(victims.values()))))

    def enforce_cover(self, running: dict[str, Running]) -> None:
        """Top up GPU tasks nearing the end of their cover; stop those refused once they reach it.

        The cover is kept ahead of the run by one poll: a top-up is asked once the
        task will have used TOP_UP_AT of its cover by the next poll, and as many
        as it takes in one poll when polls came late (a loaded control plane), so
        a task is not left running past its cover between two polls. A task
        cannot have run longer than it was submitted, so its start is asked from
        the workers only once it was submitted long enough ago to near its
        cover: short tasks cost no round trip at all.
        """
        now = time.monotonic()
        lead = self.settings.watch_seconds
        unknown = [k for k, r in running.items() if r.started_at is None and r.stop_reason is None and r.dask_at
                   is not None and r.admission.request.gpus and now - r.dask_at + lead >= TOP_UP_AT * r.covered_seconds]
        if unknown:
            first = {running[k].dask_keys[0]: k for k in unknown}  # a gang: when member 0 started
            for key, seconds in running_for(self.dispatcher.client, list(first)).items():
                running[first[key]].started_at = now - seconds
        for key, r in running.items():
            if r.started_at is None or r.stop_reason is not None or not r.admission.request.gpus:
                continue
            elapsed = now - r.started_at
            for _ in range(MAX_TOP_UPS_PER_POLL):
                if r.top_up_refused is not None or r.settled or elapsed + lead < TOP_UP_AT * r.covered_seconds:
                    break
                before = r.covered_seconds
                try:
                    self.top_up(r)
                except Exception:  # one run's failed top-up (retried next poll) never stops the others' checks
                    logger.exception("top-up of AI task %s failed; retrying", r.admission.task_name)
                    break
                if r.covered_seconds == before:  # not taken (settled meanwhile) or refused
                    break
            if r.top_up_refused is not None and elapsed >= r.covered_seconds:
                logger.warning("AI task %s reached the %.1fs its budget holds cover; stopping it (%s)",
                               r.admission.task_name, r.covered_seconds, r.top_up_refused)
                self.dispatcher.stop([key], "budget")

    def top_up(self, r: Running) -> None:
        """Hold more for a running GPU task, through the same authority, policy and budget checks."""
        from aisched_prefect.errors import AdmissionDenied
        from aisched_prefect.errors import InvalidLedgerInput
        from aisched_prefect.ledger import BudgetExceeded

        adm, request = r.admission, r.admission.request
        extra = top_up_room(r, request.est_seconds * self.settings.top_up_fraction, self.settings)
        if extra <= 0:  # its cover already reaches its time limit and the graces: no hold past them
            return
        bound = self.dispatcher._bound(adm)
        hour_price = bound.budget.model.gpu_hour_price(adm.priced_type) if adm.priced_type else 0.0
        usage = Usage(money=request.gpus * extra / 3600 * hour_price, gpu_hours=request.gpus * extra / 3600)
        total = adm.facts.model_copy(update={"est_seconds": r.covered_seconds + extra,
                                             "est_cost": (adm.facts.est_cost or 0) + r.extra_cost + usage.money})
        payload = {"task": adm.task_name, "flow": adm.flow_name, "tenant": adm.tenant,
                   "top_up": {"seconds": extra, "covered_before": r.covered_seconds, "cost": usage.money,
                              "total_cost": total.est_cost}}
        why = None
        try:
            stages.authority(self.state.snapshot, bound, total, adm.chain[-1])
            outcome = stages.policy(bound, total)
            if outcome is not None and outcome.action == "ask":
                why = (f"approval policy rule {outcome.rule!r} asks a person for a run this large, and a running task "
                       "cannot wait for one; declare est_seconds that covers the run so it is approved at admission")
        except AdmissionDenied as exc:
            why = f"{exc.stage}: {exc.reason}"
        if why is None:
            lines = stages.lines(bound, adm.facts, usage, adm.shares, self.dispatcher.ledger.now())
            try:  # atomically with the run's settlement: a run settled meanwhile takes no top-up
                r.add_holds(lambda: self.dispatcher.ledger.reserve(
                    lines, kind="top-up", payload=payload, **adm.ids)[0], extra, usage.money)
            except (BudgetExceeded, InvalidLedgerInput) as exc:
                why = f"budget: {exc}"
            else:
                return
        r.top_up_refused = why
        self.dispatcher.ledger.record("top-up-refused", {**payload, "reason": why}, **adm.ids)
