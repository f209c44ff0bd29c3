"""Runs: a flow's AI task calls, from the bytes received to the reply filed once.

A call is checked (its shipped code against its digest, the caller's runs and bytes in flight, the flow
and task run it files under), claimed in the call book (a call sent again is never run twice; one in
flight on another replica is Busy), admitted (or ended at admission: denied, or waiting for a person at
the approvals desk), handed to the dispatcher, and its reply filed and passed to whoever waits for it
(the session's outcome stream, or the blocking caller). A lost large result is reported here too.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aisched_prefect.control.authority import records
from aisched_prefect.control.admission.record import Admission
from aisched_prefect.control.calls import CallBook, CallTakenOver, call_key, callers_key
from aisched_prefect.control.authority.credentials import Unauthorized, who
from aisched_prefect.control.dispatch.dispatcher import Dispatcher
from aisched_prefect.control.authority.identity import Credential
from aisched_prefect.control.outcomes import OutcomeBook, result_digest
from aisched_prefect.control.admission.pipeline import Pipeline
from aisched_prefect.control.dispatch.running import BodyParts, denied
from aisched_prefect.control.dispatch.warm import warm_key
from aisched_prefect.errors import AdmissionDenied, AISchedError, InvalidAIRequest, LedgerUnavailable
from aisched_prefect.ledger import Ledger
from aisched_prefect.ledger.engine import described, retryable
from aisched_prefect.request import AIRequest
from aisched_prefect.settings import Settings
from aisched_prefect.wire import ApprovalView, CallMeta, Reply
from dask_gpu.tickets import digest

logger = logging.getLogger("aisched_prefect.control")


class _Early(Exception):
    """A call that ends at admission waiting for a person: its reply."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply


class Busy(AISchedError):
    """The call is in flight on another live replica: the client waits and sends it again."""

    status = 409


class NoKeptResult(AISchedError):
    """A report of a lost result about a call that is not the caller's, not done, or whose result was not kept on a
    worker (404: another caller's call is not told apart from one that does not exist)."""

    status = 404


class TooMuchInFlight(AISchedError):
    """One credential's runs or body bytes in flight reached their limit (429)."""

    status = 429


def _check_shipped(fn_bytes: bytes, said: str) -> None:
    """Code that travels as source is hashed here, from the bytes that will run: a call whose digest is not its
    source's is refused before anything is held (the body checks it again; pickled code only the body can check)."""
    from pydantic import ValidationError

    from dask_gpu.body.code import shipped_digest

    try:
        found = shipped_digest(fn_bytes)
    except (ValidationError, ValueError) as exc:
        raise InvalidAIRequest(f"the call's shipped source is malformed ({type(exc).__name__}). Fix: send the code "
                               "as aisched_prefect's runner does (dask_gpu.body.code.ship)") from None
    if found is not None and found != said:
        raise InvalidAIRequest(f"code_digest {said[:12]}... is not the digest of the call's shipped source "
                               f"({found[:12]}...). Fix: compute it with ShippedCode.digest() over the files sent")


def _digest_parts(*parts: bytes) -> str:
    """sha256 of the parts back to back, without joining them (a large body is not copied to be hashed).

    >>> _digest_parts(b"ab", b"c") == digest(b"abc")
    True
    """
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()


def abandon_waiting(dispatcher: Dispatcher, keys: list[str]) -> None:
    """A flow process stopped polling for its outcomes: its runs still waiting in the queue are taken out."""
    stopped = dispatcher.abandon(set(keys))
    if stopped:
        logger.warning("a flow process went away: %d of its waiting AI task runs leave the queue", stopped)


class CallAdmitter:
    """The pipeline as one call's admitter in dispatch: a map's shard held as it starts, or a preempted run admitted
    again, files its new holds with its call in the hold's transaction, so a replica that takes the call over
    settles those, not holds already settled, and does not hold again."""

    def __init__(self, pipeline: Pipeline, calls: CallBook, key: str) -> None:
        self.pipeline, self.calls, self.key = pipeline, calls, key

    def readmit(self, admission: Admission, reason: str) -> Admission:
        return self.pipeline.readmit(admission, reason, self._file)

    def hold_at_start(self, admission: Admission) -> Admission:
        return self.pipeline.hold_at_start(admission, self._file)

    def _file(self, conn: Any, admission: Admission) -> None:
        self.calls.admitted(self.key, admission.model_dump(mode="json"), conn)


class Runs:
    """Admits, starts and files the calls of flows; bounds what one credential keeps in flight."""

    def __init__(self, settings: Settings, ledger: Ledger, dispatcher: Dispatcher, pipeline: Pipeline,
                 calls: CallBook, outcomes: OutcomeBook, replica: str) -> None:
        self.settings, self.ledger, self.dispatcher, self.pipeline = settings, ledger, dispatcher, pipeline
        self.calls, self.outcomes, self.replica = calls, outcomes, replica
        self._flight_lock = threading.Lock()
        self._in_flight: dict[str, tuple[int, int]] = {}  # credential id -> (runs, body bytes) accepted, not ended
        self._mine: set[str] = set()  # keys this process claimed and has not filed done (admitting, running, filing)
        self._unfiled: dict[str, tuple[Reply, bytes]] = {}  # ended, their reply not yet in the call book (database down)
        self._admitting = ThreadPoolExecutor(max_workers=settings.admission_threads, thread_name_prefix="aisched-admit")

    def close(self) -> None:
        self._admitting.shutdown(wait=False)

    def call(self, cred: Credential, meta: CallMeta, blob: bytes) -> tuple[Reply, bytes]:
        """Admit one call (or continue it once approved), run it, settle it: the blocking form (one request held
        for the run's whole life; `submit_many` and the outcome stream are what runners use)."""
        if not 0 < meta.args_offset <= len(blob):
            raise InvalidAIRequest("args_offset is outside the body: the call is malformed")
        reply, out = self.submit(cred, meta, (blob[:meta.args_offset], blob[meta.args_offset:]), None)
        if reply.status != "accepted":
            return reply, out
        got = self.outcomes.wait_one(reply.key)
        assert got is not None
        return got

    def submit_many(self, cred: Credential, session: str, calls: list[tuple[CallMeta, tuple[bytes, bytes]]]
                    ) -> list[Reply]:
        """Admit many calls of one flow process at once and start them; each reply says accepted (its outcome comes
        on the session's stream), or how it ended at admission. One bad call fails only itself."""
        if not self.outcomes.owns(session, who(cred)):
            raise Unauthorized("this session belongs to another principal: a runner chooses a fresh random one", 403)
        def one(item: tuple[CallMeta, tuple[bytes, bytes]]) -> Reply:
            try:
                return self.submit(cred, item[0], item[1], session)[0]
            except Busy as exc:
                return Reply(status="failed", error_type="busy", error_message=str(exc))
            except Exception as exc:
                if isinstance(exc, LedgerUnavailable) or retryable(exc):  # the database went away: sent again
                    return Reply(status="failed", error_type="busy", error_message=f"the ledger is unreachable "
                                 f"({described(exc)}): wait for it (the client retries)")
                if not isinstance(exc, (AISchedError, ValueError)):
                    raise
                return Reply(status="denied", stage="request", reason=str(exc),
                             fix=str(exc).split("Fix: ", 1)[1] if "Fix: " in str(exc) else "")

        # A few admissions at a time: the ledger's group commit books their holds in shared transactions.
        return list(self._admitting.map(one, calls)) if len(calls) > 1 else [one(calls[0])]

    def submit(self, cred: Credential, meta: CallMeta, body: tuple[bytes, bytes], session: str | None
               ) -> tuple[Reply, bytes]:
        """Admit one call and start it without waiting for it: `accepted` (its outcome goes to `session`, or to
        `wait_one` when None), or the reply it ended with at admission (denied, waiting for a person).

        `body`: the function's pickle and the arguments' (kept apart until the run is handed to Dask, so the
        waiting runs of a `.map()` share one copy of their function)."""
        if cred.role != "flow":
            raise Unauthorized("only a flow's credential runs AI tasks", 403)
        fn_bytes, args_bytes = body
        if not fn_bytes:
            raise InvalidAIRequest("the call carries no function: it is malformed")
        self._check_in_flight(cred, len(fn_bytes) + len(args_bytes))
        payload_digest = _digest_parts(fn_bytes, args_bytes)
        args_digest = digest(args_bytes)
        function_digest = digest(fn_bytes)  # the code identity, from the bytes received (never unpickled)
        _check_shipped(fn_bytes, meta.code_digest)
        request = AIRequest.build(**meta.request)
        key = call_key(who(cred), meta.task_run_id, meta.attempt, meta.admission)
        claim, row = self.calls.check_and_claim(meta.flow_run_id, meta.task_run_id, who(cred), key)
        filed: list[str] = []  # the admission filed with the call in the transaction that took its holds
        if claim == "busy" and row.replica == self.replica:
            with self._flight_lock:  # checked and taken at once: two resends of it here take it over once
                earlier_life = key not in self._mine
                self._mine.add(key)
            if earlier_life:  # claimed under this name by an earlier process (a restart, a container's pid 1)
                claim = "takeover"
            elif key in self._unfiled:  # it ended while the database was down: its outcome is here
                reply, out = self._unfiled[key]
                if session is None:
                    return reply, out
                self.outcomes.expect(key, session, who(cred))
                self.outcomes.put(key, reply, out)
                return Reply(status="accepted", key=key), b""
            elif session is not None and self.dispatcher.has_call(key):
                self.outcomes.expect(key, session, who(cred))  # a flow re-attaching to a run it already submitted
                return Reply(status="accepted", key=key), b""
            else:
                raise Busy("this control plane is still admitting or filing this call: wait for it (the client "
                           "retries)")
        elif claim == "busy":
            raise Busy(f"this call is running on replica {row.replica}: wait for it (the client retries)")
        if claim in ("new", "takeover"):
            with self._flight_lock:
                self._mine.add(key)
        if claim == "done" and session is not None and self.outcomes.holds(session, key):
            return Reply(status="accepted", key=key), b""  # sent again after a cut: its outcome is on the stream
        if claim == "done":  # its reply was lost in transit (or this replica restarted): never run it twice
            stored, why = self.calls.reply(key, row.reply)
            old = Reply.model_validate(stored).model_copy(update={"key": key})
            kept = self.calls.out(key, row.reply)
            if kept is not None and (old.status != "completed" or result_digest(kept) == old.result_digest):
                if session is None:
                    return old, kept
                self.outcomes.expect(key, session, who(cred))  # its bytes travel on the stream, as they first would
                self.outcomes.put(key, old, kept)
                return Reply(status="accepted", key=key), b""
            if old.status != "completed" or old.result_ref is not None:  # a large result: still on its worker
                return old, b""
            lost = why or "its result's bytes travelled on the connection that was lost"
            return Reply(status="failed", key=key, admission=old.admission, error_type="aisched_prefect.ResultLost",
                         error_message=f"the call completed (and was charged once) but its result is lost: {lost}; "
                         "retry the task to run it again"), b""
        try:
            if claim == "takeover" and row.admission is not None:
                admission = Admission.model_validate(row.admission)
                records.record(self.ledger, records.AttemptLost(task=admission.task_name, admission=admission.id,
                                                                replica=row.replica, taken_over_by=self.replica),
                               **admission.ids)
            else:
                def file_with_holds(conn: Any, adm: Admission) -> None:
                    self.calls.admitted(key, adm.model_dump(mode="json"), conn)
                    filed.append(adm.id)

                # One pass of admission: a new call, or the one execution an approval allows.
                got = self.pipeline.admit(cred, meta, request, payload_digest, args_digest, file_with_holds,
                                          function_digest)
                if isinstance(got, ApprovalView):
                    raise _Early(Reply(status="approval-pending", admission=got.id, approval=got))
                admission = got
        except (_Early, AdmissionDenied) as ended:  # the call ends at admission: denied, or waiting for a person
            self._arrived(meta, None)
            reply = ended.reply if isinstance(ended, _Early) else denied(ended.stage, ended.reason, ended.fix)
            try:
                self.calls.done(key, reply.model_dump(mode="json"))
            finally:  # not filed (the database went): a retry here continues the claim as an earlier life's
                self._forget(key)
            return reply.model_copy(update={"key": key}), b""
        except CallTakenOver as exc:  # nothing of this admission committed: the call is the other replica's
            raise Busy(f"{exc}: wait for it (the client retries)") from None
        except BaseException:
            try:
                self.calls.release(key)
            finally:
                self._forget(key)
            raise
        if admission.id not in filed:  # taken over, or continued after an approval: filed here
            self.calls.admitted(key, admission.model_dump(mode="json"))
        self.outcomes.expect(key, session, who(cred))
        size = len(fn_bytes) + len(args_bytes)
        with self._flight_lock:
            runs, held = self._in_flight.get(cred.id, (0, 0))
            self._in_flight[cred.id] = (runs + 1, held + size)
        launched = self.dispatcher.launch(
            admission, BodyParts(fn_bytes, args_bytes, tuple(meta.modules)), CallAdmitter(self.pipeline, self.calls, key),
            lambda reply, out: self._finished(key, reply, out, cred.id, size), call_key=key)
        self._arrived(meta, admission)
        # A run only a group of the scaler at 0 jobs holds: its flow's log says what it waits for.
        return Reply(status="accepted", key=key, admission=admission.id,
                     reason=self.dispatcher.capacity_note(launched) if launched else ""), b""

    def _arrived(self, meta: CallMeta, admission: Admission | None) -> None:
        """A shard of a map reached the plane: its map's bodies wait for the shards still to come
        (control.dispatch.warm_tail.Arrivals)."""
        if meta.array is not None:
            self.dispatcher.arrivals.arrived(meta.array.id, meta.array.index, meta.array.size,
                                             warm_key(admission) if admission is not None else None, meta.flow_run_id)

    def _check_in_flight(self, cred: Credential, size: int) -> None:
        """Per-credential bounds on runs and body bytes in flight: a flow cannot make the plane hold unbounded work."""
        with self._flight_lock:
            runs, held = self._in_flight.get(cred.id, (0, 0))
        if runs >= self.settings.max_runs_in_flight:
            raise TooMuchInFlight(f"{cred.principal!r} has {runs} AI task runs in flight, the most one credential may "
                                  f"(AISCHED_MAX_RUNS_IN_FLIGHT={self.settings.max_runs_in_flight}). Fix: wait for "
                                  "some to end, or ask the operator to raise AISCHED_MAX_RUNS_IN_FLIGHT")
        if held + size > self.settings.max_bytes_in_flight:
            raise TooMuchInFlight(f"{cred.principal!r} has {held} bytes of AI task bodies in flight; this call's "
                                  f"{size} more would pass AISCHED_MAX_BYTES_IN_FLIGHT="
                                  f"{self.settings.max_bytes_in_flight}. Fix: send large inputs by reference "
                                  "(object storage paths), or ask the operator to raise the limit")

    def _finished(self, key: str, reply: Reply, out: bytes, credential: str = "", size: int = 0) -> None:
        """A run ended (in its dispatch thread): its reply is filed once, then handed to whoever waits for it."""
        if credential:
            with self._flight_lock:
                runs, held = self._in_flight.get(credential, (1, size))
                self._in_flight[credential] = (max(runs - 1, 0), max(held - size, 0))
        reply = reply.model_copy(update={"key": key, "result_digest": result_digest(out) if out else reply.result_digest})
        try:
            self.calls.done(key, reply.model_dump(mode="json"), out)
        except Exception as exc:  # the outcome still reaches its caller; kept here and filed again (`refile`)
            logger.warning("could not file the reply of call %s (filed again later): %s", key, exc)
            with self._flight_lock:
                self._unfiled[key] = (reply, out)
        else:
            self._forget(key)
        self.outcomes.put(key, reply, out)

    def refile(self) -> None:
        """File the replies that could not be filed when their runs ended (a chore: the database came back)."""
        with self._flight_lock:
            waiting = list(self._unfiled.items())
        for key, (reply, out) in waiting:
            try:
                self.calls.done(key, reply.model_dump(mode="json"), out)
            except Exception as exc:  # still down: the next chore tries again
                logger.debug("call %s still unfiled: %s", key, exc)
                return
            with self._flight_lock:
                self._unfiled.pop(key, None)
            self._forget(key)

    def _forget(self, key: str) -> None:
        with self._flight_lock:
            self._mine.discard(key)

    def result_lost(self, cred: Credential, key: str, reason: str) -> dict[str, Any]:
        """A flow could not fetch its completed call's large result from the worker that kept it (every attempt failed:
        404, refused, cut, timed out). The run stays settled as it ran (charged); one `result-lost` record about its
        admission says so, naming the worker (as the call book has it) and the flow's reason. Reported again: the
        record already filed."""
        if cred.role != "flow":
            raise Unauthorized("only a flow's credential reports its lost results", 403)
        row = self.calls.get(key) if callers_key(who(cred), key) else None
        reply = (row.reply or {}) if row is not None and row.status == "done" else {}
        ref = reply.get("result_ref")
        if reply.get("status") != "completed" or not isinstance(ref, dict) or row.admission is None:
            raise NoKeptResult(f"no completed call {key!r} of yours kept its result on a worker. Fix: report the key "
                               "of the reply whose result_ref could not be fetched")
        adm = Admission.model_validate(row.admission)
        about = self.ledger.records_about(adm.task_run_id)
        for r in about:
            if r.kind == "result-lost" and r.payload.get("call") == key:
                return {"record": r.seq, "kind": r.kind, "already": True}
        settled = [r.seq for r in about if r.kind == "settlement" and r.payload.get("admission") == adm.id]
        rec = records.record(self.ledger, records.ResultLostRecord(
            call=key, task=adm.task_name, admission=adm.id, worker=str(ref.get("url", "")), reason=reason[:1000],
            settlement=settled[-1] if settled else None, reported_by=cred.principal), **adm.ids)
        logger.warning("AI task %s (admission %s): its flow could not fetch its result from %s: %s", adm.task_name,
                       adm.id, ref.get("url"), reason[:200])
        return {"record": rec.seq, "kind": rec.kind, "already": False}
