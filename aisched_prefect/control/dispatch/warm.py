"""The control plane's books of warm bodies: whose idle time each one's device share is, held and settled once.

A body that stays warm after a run (dask_gpu.worker.bodies) keeps its device share while it waits for the next run of its
key: that time is its principal's, charged as its own kind (`warm-idle`) on the budget lines of the run that left
it warm. As the run is settled, a hold for the body's whole keep-warm time (its share of the GPU, at the GPU type it
ran on) is taken on those lines; a hold that does not fit ends the body (no idle time is run on credit). The idle
period ends when the next run of its key starts in it (the run's outcome says how long it waited), when its worker
ends it (the `aisched-warm-body` event says so) or when its worker dies (the ticket registry's `aisched-worker-died`
event, sent for every worker that leaves); either way the hold is settled once with the idle seconds, at most the
keep-warm time, and through a ledger outage with the retries a run's settlement uses (control.outlast). A run that
took the body and leaves it warm again carries the period on under the same hold while that hold covers it
(`_carry`): a map's back-to-back shards in one body share one hold and one settlement record listing each wait.

Each idle period is a row (control.dispatch.warm_rows), written in the transaction that takes its hold (and moved
in the one that settles it), before it is kept here: a plane killed and started again, or
another replica, loads the idle bodies from the rows, ends those whose authority ended and settles their idle time;
reconciling with what the workers report (control.warm_reconcile) settles the ones that ended unheard. The hold's
lease runs a little past the keep-warm time, so a body nobody accounts for expires charged at most that. A body
whose last run's authority ended (a revoked or expired credential or grant, a withdrawn delegation, a budget cut
below what it holds) is ended within a watcher poll.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from aisched_prefect.control.admission import stages
from aisched_prefect.control.admission.record import Admission
from aisched_prefect.control.dispatch.outlast import outlasting
from aisched_prefect.control.dispatch.warm_rows import BodyRows, CarriedOn, IdleRow
from aisched_prefect.ledger import Hold, Ledger
from blocks import MAX_AMOUNT, Usage

logger = logging.getLogger("aisched_prefect.control")
LEASE_MARGIN_SECONDS = 60.0  # a warm-idle hold's lease runs this far past the keep-warm time
STRETCH_SECONDS = 15.0  # back-to-back runs share one idle hold for at most this long (well inside its lease margin)
STRETCH_WAITS = 64  # ... for at most this many waits (each listed in its row and its settlement record)
STRETCH_SHARE = 0.5  # ... and while their idle seconds add up to at most this share of the keep-warm time it covers
SPENT_MARGIN_SECONDS = 2.0  # a carried period's body ends this long (at most a quarter of it) before its hold runs out
EARLY_KEPT = 10_000  # ends heard before their period was booked, kept (the oldest dropped first) until it is


def warm_key(admission: Admission) -> str:
    """What a warm body serves: one tenant's one principal's one code, with one request (devices, share, type),
    decided under one authority: the applied authority block (name and version) and the grant chain (ids). The same
    principal name under another authority block, or through another grant, gets a body of its own."""
    text = "\0".join((admission.tenant, admission.principal, admission.code_digest, admission.request.digest,
                      admission.versions.get("authority", ""), "/".join(admission.chain)))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _ids(adm: Admission, body: str, runs: int) -> dict[str, Any]:
    """An idle period's records and holds: the run's flow run and principal, a task run id of its own (a report
    shows it as its own row, not inside the run that left the body warm)."""
    return {**adm.ids, "task_run_id": f"warm-{body}-{runs}"}


def _as_run(adm: Admission, gpu_type: str | None, worker: str) -> dict[str, Any]:
    """What a usage report reads of an idle period, as of a run: kind `warm-idle`, the share it held, where."""
    return {"request": {"kind": "warm-idle", "gpus": adm.request.gpus, "model": adm.request.model},
            "placement": {"gpu_type": gpu_type, "worker": worker}}


@dataclass
class WarmIdle:
    """One idle period of one body: the hold that covers it and what it is charged to."""

    body: str
    runs: int  # the body's run count when it went idle (names this idle period)
    admission: Admission  # the run that left it warm: its principal, lines and authority
    holds: list[Hold]
    keep: float
    gpu_type: str | None
    worker: str
    since: float  # the plane's clock (time.time()) when its current wait began: rows carry it across a restart
    before: float = 0.0  # carried on (`WarmBooks._carry`): the seconds of its earlier waits, back-to-back runs between
    gaps: tuple[tuple[str, float], ...] = ()  # those waits: the admission of the run that ended each, its seconds
    opened: float | None = None  # when its hold was taken (None: at `since`, or not known where it was carried on)

    def __post_init__(self) -> None:
        if self.opened is None:  # a carried period loaded from its row is never carried on again: its hold's age
            self.opened = 0.0 if self.gaps else self.since  # is not known here

    @property
    def held_runs(self) -> int:
        """The run count its hold was taken at (names its hold's records; one run a carried wait)."""
        return self.runs - len(self.gaps)

    def idle_at(self, at: float | None = None) -> float:
        """Its current wait so far (what `WarmBooks.ended` takes: the earlier waits it adds itself)."""
        return min(max((time.time() if at is None else at) - self.since, 0.0), self.keep)

    def held_at(self, at: float | None = None) -> float:
        """All of its waits so far: what its hold covers."""
        return min(self.before + self.idle_at(at), self.keep)


def _period(row: IdleRow) -> WarmIdle:
    return WarmIdle(row.body, row.runs, row.admission, row.holds, row.keep, row.gpu_type, row.worker, row.idle_since,
                    row.before, row.waits)


def _accounts(holds: list[Hold]) -> set[tuple[str, str]]:
    return {(h.budget, h.period) for h in holds}


def carries(p: WarmIdle, adm: Admission, body: dict[str, Any], gpu_type: str | None, worker: str, idle: float,
            now: float) -> bool:
    """Whether run `adm`, which took the body of period `p` after `idle` seconds and left it warm again (`body`: its
    outcome's word), may carry the period on under its hold (pure; `WarmBooks._carry` says why these)."""
    return (p.worker == worker and p.gpu_type == gpu_type and p.keep == float(body.get("keep") or 0.0)
            and now - (p.opened or 0.0) <= STRETCH_SECONDS and p.before + idle <= p.keep * STRETCH_SHARE
            and len(p.gaps) < STRETCH_WAITS and p.admission.flow_run_id == adm.flow_run_id
            and _accounts(p.holds) == _accounts(adm.holds))


def settled_elsewhere(idle: dict[tuple[str, int], WarmIdle], rows: set[tuple[str, int]], read_at: float,
                      carrying: set[str]) -> list[tuple[str, int]]:
    """The periods booked here that the idle rows read at `read_at` say another replica settled (pure). Not one
    booked (or carried on) while the rows were read, nor one whose body's row names a later period: outcomes
    settled out of order booked that one over it (a body has one row), and its end comes with the outcome of the
    run that took the body."""
    latest: dict[str, int] = {}
    for body, runs in rows:
        latest[body] = max(latest.get(body, runs), runs)
    return [k for k, p in idle.items()
            if k not in rows and p.since < read_at and k[0] not in carrying and latest.get(k[0], -1) < k[1]]


def spent(periods: list[WarmIdle], now: float) -> list[str]:
    """The bodies whose carried period's waits have come within SPENT_MARGIN_SECONDS (at most a quarter of the
    keep-warm time) of its hold (pure)."""
    return [p.body for p in periods if p.before > 0 and p.held_at(now) >= p.keep - min(SPENT_MARGIN_SECONDS, p.keep / 4)]


class WarmBooks:
    """Idle periods of warm bodies, from the outcome that starts one to the report that ends it; kept as rows, and
    here for the watcher's polls."""

    def __init__(self, ledger: Ledger, bound: Callable[[Admission], stages.Bound],
                 end_bodies: Callable[[list[str], str], None], patience: float = 60.0) -> None:
        self.ledger, self._bound, self._end_bodies, self.patience = ledger, bound, end_bodies, patience
        self.rows = BodyRows(ledger)
        self._idle: dict[tuple[str, int], WarmIdle] = {}
        self._early: dict[tuple[str, int], tuple[float, str]] = {}  # ends reported before their period was booked
        self._ending: set[str] = set()  # bodies asked to end: asked once
        self._gone: dict[tuple[str, int], None] = {}  # periods ended here lately: a row read before is stale
        self._carrying: dict[str, threading.Event] = {}  # bodies whose period a run is carrying on (its row moving)
        self._lock = threading.Lock()

    def load(self) -> int:
        """The idle bodies the rows know (booked by another replica, or by this plane before it was killed) join
        these books; periods another replica settled leave them. How many are idle now."""
        read_at = time.time()
        rows = {(r.body, r.runs): r for r in self.rows.load_idle()}
        with self._lock:
            for key, row in rows.items():
                if key not in self._gone and key[0] not in self._carrying:
                    self._idle.setdefault(key, _period(row))
            for key in settled_elsewhere(self._idle, set(rows), read_at, set(self._carrying)):
                del self._idle[key]
            return len(self._idle)

    def _lines(self, adm: Admission, gpu_type: str | None, seconds: float) -> tuple[list[Any], dict[str, float]]:
        """The budget lines and charges of `seconds` of the run's GPU share at `gpu_type` (no tokens: idle)."""
        bound = self._bound(adm)
        money = bound.budget.model.actual_cost(adm.request.gpus, seconds, gpu_type or adm.priced_type)
        used = Usage(money=money, gpu_hours=adm.request.gpus * seconds / 3600)
        facts = adm.facts.model_copy(update={"gpu_types": (gpu_type,)}) if gpu_type else adm.facts
        lines = stages.lines(bound, facts, used, adm.shares, self.ledger.now())
        return lines, {line.budget: min(line.amount, MAX_AMOUNT) for line in lines}

    def started(self, adm: Admission, body: dict[str, Any], gpu_type: str | None, worker: str) -> None:
        """A run's outcome: it began an idle period (`kept`), and a warm start ended the one before it (or, run
        straight after it, carried it on: `_carry`)."""
        if body.get("start") == "warm" and body.get("kept") and self._carry(adm, body, gpu_type, worker):
            return
        if body.get("start") == "warm":
            self.ended(body["id"], int(body["runs"]) - 1, float(body.get("idle_before") or 0.0), "a run of its key",
                       taken=True)
        if not body.get("kept"):
            if body.get("start") == "warm":  # its row said idle, then running: now it ended with its run
                self._row(body["id"], lambda: self.rows.ended_cold(body["id"], adm, worker, warm_key(adm),
                                                                   "it ended with its run", time.time()))
            return
        key, keep = (body["id"], int(body["runs"])), float(body.get("keep") or 0.0)
        from aisched_prefect.errors import InvalidLedgerInput, LedgerUnavailable
        from aisched_prefect.ledger import BudgetExceeded

        payload = {"task": adm.task_name, "flow": adm.flow_name, "tenant": adm.tenant, "body": body["id"],
                   "keep_seconds": keep, "worker": worker, "admission": adm.id, **_as_run(adm, gpu_type, worker)}
        since = time.time()
        row = self.rows.idle_op(body["id"], key[1], adm, keep, gpu_type, worker, warm_key(adm), since, since)
        try:
            lines, _ = self._lines(adm, gpu_type, keep)
            holds, _ = self.ledger.reserve(lines, kind="warm-hold", payload=payload,
                                           lease_seconds=keep + LEASE_MARGIN_SECONDS, **_ids(adm, *key),
                                           also=lambda conn, held, _rec: row(conn, held))
        except (BudgetExceeded, InvalidLedgerInput) as exc:
            self.ledger.record("warm-refused", {**payload, "reason": str(exc)}, **_ids(adm, *key))
            why = f"its idle time is not covered: {exc}"
            self._row(body["id"], lambda: self.rows.ended_cold(body["id"], adm, worker, warm_key(adm), why, time.time()))
            self._end_bodies([body["id"]], f"its idle time is not covered: {exc}")
            return
        except LedgerUnavailable as exc:  # the run itself is settled: only its body's idle time goes unheld, so it ends
            logger.warning("warm body %s ends: its idle time could not be held (%s)", body["id"], exc)
            self._end_bodies([body["id"]], f"its idle time could not be held: {exc}")
            return
        period = WarmIdle(body["id"], key[1], adm, holds, keep, gpu_type, worker, since)  # its row with its hold
        with self._lock:
            if key not in self._gone:  # else it ended (its row read) between the row's write and now: settled once
                self._idle[key] = period
            early = self._early.pop(key, None)
        if early is not None:
            self.ended(body["id"], key[1], *early)

    def _carry(self, adm: Admission, body: dict[str, Any], gpu_type: str | None, worker: str) -> bool:
        """A run that took a warm body and left it warm again carries the body's idle period on instead of settling
        it and holding a new one (two ledger writes and two records a shard of a map): its wait is added to the
        period's seconds and the period waits again under the same hold. Only while that hold covers it: the same
        worker, device type, keep-warm time, flow run and budget accounts, for at most STRETCH_SECONDS since the hold
        was taken (its lease runs LEASE_MARGIN_SECONDS past the keep-warm time) and while the waits add up to at
        most STRETCH_SHARE of the keep-warm time; otherwise the period is settled and a new one held, as before.
        Whether it was carried on."""
        runs, idle, now = int(body["runs"]), max(float(body.get("idle_before") or 0.0), 0.0), time.time()
        prev = (body["id"], runs - 1)
        with self._lock:
            p = self._idle.get(prev)
            if (p is None or p.body in self._ending or p.body in self._carrying
                    or not carries(p, adm, body, gpu_type, worker, idle, now)):
                return False
            carrying = self._carrying[p.body] = threading.Event()  # `ended` and `load` wait for it, or leave it be
        # Its row moved first (a plane started again, or a replica, knows the waits and the run that carried it
        # last), then a new period object booked (one a reconcile pass copied before stays as it was: its stale
        # word misses); its wait starts after the move (a `load` that read the rows before it keeps it).
        before, gaps, early = p.before + idle, (*p.gaps, (adm.id, idle)), None
        try:
            moved = self.rows.carry(p.body, prev[1], runs, adm, now, before, list(gaps))
        except Exception:  # the ledger is out: settled and held anew the usual way, through the outage
            logger.warning("could not carry on the idle period of warm body %s", p.body, exc_info=True)
            moved = False
        try:
            with self._lock:
                if not moved or self._idle.get(prev) is not p:  # it ended meanwhile (its hold settled): held anew
                    return False
                del self._idle[prev]
                self._gone_now(prev)  # rows read before the move still name it
                self._idle[(p.body, runs)] = replace(p, runs=runs, admission=adm, since=time.time(), before=before,
                                                     gaps=gaps)
                early = self._early.pop((p.body, runs), None)
        finally:
            with self._lock:
                del self._carrying[p.body]
            carrying.set()
        if early is not None:
            self.ended(p.body, runs, *early)
        return True

    def _row(self, body: str, write: Callable[[], Any]) -> bool:
        """Write a body's row, through a ledger outage as a settlement is; whether it was written (else logged: the
        books here still hold the period, and its hold's lease bounds what it can cost)."""
        try:
            outlasting(write, patience=self.patience, what=f"warm body {body} changed")
            return True
        except Exception:
            logger.exception("could not write the row of warm body %s", body)
            return False

    def ended(self, body: str, runs: int, idle: float, why: str, worker: str | None = None,
              taken: bool = False) -> None:
        """An idle period ended, its last wait `idle` seconds long (a carried period adds its earlier waits): settle
        its hold once (an end that came first waits for it).
        `worker`: the worker that says so; only the body's own worker's word ends its period. `taken`: a run of its
        key took the body (it lives on)."""
        with self._lock:
            carrying = self._carrying.get(body)
        if carrying is not None:  # a run is carrying its period on: what is said of it is said of it after that
            carrying.wait(self.patience)
        with self._lock:
            found = self._idle.get((body, runs))
            if found is not None and worker is not None and found.worker != worker:
                return
            period = self._idle.pop((body, runs), None)
            self._ending.discard(body)
            if period is not None:
                self._gone_now((body, runs))
        if period is None:  # booked by another replica, or by this plane's earlier life: its row says
            try:
                rows = outlasting(lambda: self.rows.load_idle(body, runs), patience=self.patience,
                                  what=f"the idle time of warm body {body} ended")
            except Exception:
                logger.exception("could not read the row of warm body %s; its hold expires", body)
                return
            period = _period(rows[0]) if rows else None
            if period is None or (worker is not None and period.worker != worker):
                if period is None:  # its outcome is still being booked (control.dispatch.warm.started settles it then)
                    with self._lock:  # the oldest goes first: an end whose period was never booked stays no longer
                        self._early[(body, runs)] = (idle, why)
                        if len(self._early) > EARLY_KEPT:
                            del self._early[next(iter(self._early))]
                return
            with self._lock:  # settled from its row: the books here (booked meanwhile) do not hold it again
                self._idle.pop((body, runs), None)
                self._gone_now((body, runs))
        last = min(max(idle, 0.0), period.keep)
        seconds = min(period.before + last, period.keep)
        adm = period.admission
        at = period.since + last  # when it ended, as far as the books can tell (not when this was heard)
        row = self.rows.left_idle_op(body, runs, taken=taken, why=why, at=at, holds=[h.id for h in period.holds])
        waits = {"periods": len(period.gaps) + 1,  # each wait, and the run that ended it: one record for the stretch
                 "waits": [{"admission": a, "seconds": s} for a, s in period.gaps]} if period.gaps else {}
        try:  # the hold settled and the row moved in one transaction
            _, charges = self._lines(adm, period.gpu_type, seconds)
            outlasting(lambda: self.ledger.settle([h.id for h in period.holds], charges, kind="warm-idle", payload={
                "task": adm.task_name, "flow": adm.flow_name, "tenant": adm.tenant, "body": body,
                "outcome": "warm-idle", "seconds": seconds, "ended": why, "worker": period.worker,
                "admission": adm.id, "charges": charges, **waits, **_as_run(adm, period.gpu_type, period.worker)},
                **_ids(adm, body, period.held_runs), also=row), patience=self.patience,
                what=f"the idle time of warm body {body} ended")
        except CarriedOn as exc:  # a stale word (another replica's, or a pass that asked before the carry): nothing
            logger.info("%s: settled by whoever carries it", exc)  # settled; its row says where it stands now
        except Exception:  # its hold expires (charged at most the keep-warm time): never lost, never twice
            logger.exception("could not settle the idle time of warm body %s", body)
            # its row still says idle: a plane that loads it settles it then (settling twice changes nothing)

    def _gone_now(self, key: tuple[str, int]) -> None:
        """A period is being settled (the lock held): a row read before, or a booking that finishes after, is stale."""
        self._gone[key] = None
        if len(self._gone) > 10_000:
            del self._gone[next(iter(self._gone))]

    def on_event(self, event: tuple[float, dict[str, Any]]) -> None:
        """The worker's `aisched-warm-body` event: a body ended while it waited (runs in the Dask client's loop)."""
        msg = event[1]
        if not isinstance(msg, dict) or "body" not in msg:
            return
        threading.Thread(target=self.ended, args=(str(msg["body"]), int(msg.get("runs") or 0),
                                                  float(msg.get("idle") or 0.0), str(msg.get("reason") or ""),
                                                  str(msg.get("worker") or "")),
                         name="aisched-warm-settle", daemon=True).start()

    def worker_died(self, worker: str, at: float | None = None) -> list[str]:
        """A worker left (at `at`, the plane's clock; now if None): its bodies are gone; their idle time counts up to
        then, whatever ran on it and whichever replica or earlier life booked them. Their ids."""
        try:
            self.load()
        except Exception:  # the ledger is out: the periods booked here still settle
            logger.warning("could not read the warm bodies' rows; settling those of worker %s known here", worker)
        with self._lock:
            gone = [p for p in self._idle.values() if p.worker == worker]
        for p in gone:
            self.ended(p.body, p.runs, p.idle_at(at) if at is not None else p.idle_at(), f"its worker {worker} left")
        return [p.body for p in gone]

    def periods(self) -> list[WarmIdle]:
        with self._lock:
            return list(self._idle.values())

    def callers_gone(self, whos: set[str]) -> list[str]:
        """No flow process of these callers (`authority:principal`) polls any more: nothing of theirs waits, so their
        idle warm bodies end now rather than at the end of their keep-warm time; their ids."""
        with self._lock:
            victims = [p.body for p in self._idle.values() if p.body not in self._ending
                       and f"{p.admission.authority}:{p.admission.principal}" in whos]
            self._ending.update(victims)
        if victims:
            self._end_bodies(victims, "nothing of its principal waits any more")
        return victims

    def end_broken(self, why_broken: Callable[[Admission], str | None],
                   uncovered: Callable[[list[WarmIdle]], dict[str, str]] | None = None) -> list[str]:
        """End the warm bodies whose last run's authority no longer stands, or (`uncovered`: body -> why) whose
        budget no longer covers what they hold; their ids. An ended body's idle time is settled as its worker
        reports the end."""
        with self._lock:
            periods = [p for p in self._idle.values() if p.body not in self._ending]
        memo: dict[str, str | None] = {}
        victims = {p.body: why for p in periods
                   if (why := memo[p.admission.id] if p.admission.id in memo else
                       memo.setdefault(p.admission.id, why_broken(p.admission))) is not None}
        if uncovered is not None and periods:
            victims.update({b: w for b, w in uncovered(periods).items() if b not in victims})
        for why in sorted(set(victims.values())):
            bodies = [b for b, w in victims.items() if w == why]
            with self._lock:
                self._ending.update(bodies)
            self._end_bodies(bodies, f"its authority ended: {why}")
        if victims:
            logger.warning("authority withdrawn: ending %d idle warm bod%s", len(victims),
                           "y" if len(victims) == 1 else "ies")
        return list(victims)

    def close(self) -> None:
        """The plane stops: its warm bodies end (nobody would account for their idle time) and each idle period is
        settled with the time it had, rather than left to expire charged in full."""
        with self._lock:
            periods = list(self._idle.values())
        if not periods:
            return
        try:
            self._end_bodies([p.body for p in periods], "the control plane stopped")
        except Exception:  # the cluster is gone already: the bodies end with their workers
            logger.warning("could not reach the workers to end %d warm bodies", len(periods))
        for p in periods:
            self.ended(p.body, p.runs, p.idle_at(), "the control plane stopped")

    def idle_periods(self) -> list[WarmIdle]:
        """The idle periods now (a copy), for what decides when a body ends (control.dispatch.warm_tail)."""
        with self._lock:
            return [p for p in self._idle.values() if p.body not in self._ending]

    def end_idle(self, bodies: list[str], why: str) -> list[str]:
        """Ask the workers to end these bodies, each once, if still idle (a run that took one keeps it)."""
        with self._lock:
            idle = {p.body for p in self._idle.values()}
            asked = [b for b in bodies if b in idle and b not in self._ending]
            self._ending.update(asked)
        if asked:
            self._end_bodies(asked, why)
        return asked

    def end_spent(self, now: float | None = None) -> list[str]:
        """End the bodies whose carried idle period is about to use up its hold; their ids. Why: the worker ends a
        body after its keep-warm time idle since its *last* run, but a carried period's hold covers that time
        counted from its *first* wait, so the plane ends it as its waits reach the hold, a margin early (the watcher
        calls this every poll)."""
        bodies = spent(self.idle_periods(), time.time() if now is None else now)
        return self.end_idle(bodies, "its idle hold is used up") if bodies else []

    def idle_count(self) -> int:
        with self._lock:
            return len(self._idle)
