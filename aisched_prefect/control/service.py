"""The control plane: the one process that holds authority, money and evidence, and the only Dask client.

`ControlPlane` owns, in one ExitStack: the ledger (its database credentials),
the signing key (tickets and checkpoints), the folded authority state, the
Dask client (and the local cluster when it starts one), the admitter, the
dispatcher, the approval book and the watcher. The HTTP app (app.py) is a thin
shell over its methods; every method takes the caller's proven credential.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from aisched_prefect.approvals import ApprovalDecision
from aisched_prefect.control.admission import Admission, Admitter, ApprovalNeeded
from aisched_prefect.control.approvals import ApprovalBook, ApprovalError
from aisched_prefect.control import records
from aisched_prefect.control.calls import TOKEN_PURPOSE, CallBook, CallTakenOver, TokenSeal, call_key, callers_key
from aisched_prefect.control.outcomes import OutcomeBook, result_digest
from aisched_prefect.control.dispatch import Dispatcher
from aisched_prefect.control.running import BodyParts, denied
from aisched_prefect.control.settlement import emit_budget_alert
from aisched_prefect.control.identity import Credential, Role, new_credential, parse_token
from aisched_prefect.control.keys import derived_secret, load_or_make_key, write_private  # noqa: F401 - where callers look
from aisched_prefect.control.state import CONFIG_KINDS, Applied, AuthorityState, content_digest
from aisched_prefect.control.watcher import Watcher
from aisched_prefect.errors import (
    AdmissionDenied,
    AISchedError,
    InvalidAIRequest,
    InvalidConfig,
    InvalidLedgerInput,
    TooManyOpenApprovals,
    shown,
)
from aisched_prefect.ledger import Ledger
from aisched_prefect.request import AIRequest
from aisched_prefect.settings import Settings
from aisched_prefect.wire import ApprovalView, CallMeta, Reply
from blocks import ChainBroken, DelegationRefused, Grant, delegate
from dask_gpu import LocalGPUCluster
from dask_gpu.security import ClusterTLS
from dask_gpu.limits import install_limits
from dask_gpu.tickets import TicketSigner, digest, install_registry

logger = logging.getLogger("aisched_prefect.control")


def _roots_in(snap: Any, authority: Applied, grant_id: str) -> bool:
    """Whether `grant_id` was delegated under `authority`."""
    return grant_id in snap.delegated_in(authority)


def _who(cred: Credential) -> str:
    """A flow's identity across authorities: one principal name may be issued under several."""
    return f"{cred.authority}:{cred.principal}"


def _owns(cred: Credential, adm: Admission) -> bool:
    return cred.principal == adm.principal and cred.authority == adm.authority


class _Early(Exception):
    """A call that ends at admission (denied, or waiting for a person): its reply."""

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

    from dask_gpu.bodycode import shipped_digest

    try:
        found = shipped_digest(fn_bytes)
    except (ValidationError, ValueError) as exc:
        raise InvalidAIRequest(f"the call's shipped source is malformed ({type(exc).__name__}). Fix: send the code "
                               "as aisched_prefect's runner does (dask_gpu.bodycode.ship)") from None
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


class Unauthorized(AISchedError):
    """A caller without a valid credential, or with one that may not do this."""

    def __init__(self, message: str, status: int = 401) -> None:
        self.status = status
        super().__init__(message)


def role_fix(roles: tuple[str, ...]) -> str:
    """How a caller holding the wrong kind of credential gets the right one (the CLI reads AISCHED_OPERATOR_TOKEN
    first, then --token-file, then AISCHED_TOKEN, which holds a flow's or an approver's)."""
    if "operator" in roles:
        return ("run operator commands with an operator's credential: set AISCHED_OPERATOR_TOKEN to it (`aisched "
                "serve` wrote the first one to AISCHED_HOME/operator.token) or pass --token-file FILE; AISCHED_TOKEN "
                "holds a flow's credential, which may only run flows")
    if "approver" in roles:
        return "answer with an approver's credential: pass --token-file FILE, or set AISCHED_TOKEN to it"
    return "run AI tasks with a flow's credential (AISCHED_TOKEN, issued by `aisched credentials issue`)"


PRINCIPAL_LENGTH = 200  # the evidence log's and the holds' principal column


def check_principal(field: str, value: object, *, exact: bool) -> str:
    """A principal (or tenant) as the books carry it: 1 to 200 printable characters, no NUL, no space around it;
    `exact`: one principal, not a pattern (no '*', '?', '[')."""
    fix = f"name exactly one {field}, e.g. 'team-a/nightly' (at most {PRINCIPAL_LENGTH} characters)"
    if not isinstance(value, str) or not 0 < len(value) <= PRINCIPAL_LENGTH:
        raise InvalidConfig(field, value, f"a {field} is 1 to {PRINCIPAL_LENGTH} characters", fix)
    if not value.isprintable() or value != value.strip():
        raise InvalidConfig(field, value, f"a {field} has no NUL byte, control character or space around it", fix)
    if exact and set("*?[") & set(value):
        raise InvalidConfig(field, value, f"a {field} is one name, not a pattern", fix)
    return value


CONFIG_NAME_LENGTH = 100
_CONFIG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_config_name(kind: str, name: object) -> str:
    """A configuration's name as the books, the CLI and Prefect can carry it: 1 to 100 letters, digits, '.', '_'
    or '-', starting with a letter or digit (no '/', which separates a budget from its limits; no NUL)."""
    fix = f"name the {kind} block like a Prefect block, e.g. 'team-a' (at most {CONFIG_NAME_LENGTH} characters)"
    if not isinstance(name, str) or not 0 < len(name) <= CONFIG_NAME_LENGTH:
        raise InvalidConfig(f"{kind} name", name, f"a name is 1 to {CONFIG_NAME_LENGTH} characters", fix)
    if not _CONFIG_NAME.fullmatch(name):
        raise InvalidConfig(f"{kind} name", name, "a name has only letters, digits, '.', '_' and '-', and starts "
                            "with a letter or digit", fix)
    return name


class ControlPlane:
    """Admission, dispatch, settlement, approvals, authority and evidence for every flow that calls it."""

    def __init__(self, settings: Settings, *, dask_address: str | None = None, declared: str | None = None,
                 queue: bool = True, base_url: str = "", checkpoint_dir: Path | None = None,
                 key_path: Path | None = None, replica: str | None = None, dask_tls: Path | None = None) -> None:
        self.settings = settings
        self.base_url = base_url
        self.replica = replica or f"{os.uname().nodename}-{os.getpid()}"
        self.checkpoint_dir = checkpoint_dir
        self._drift_seen: set[tuple[str, str, str]] = set()
        self._checkpointed = -1
        self._signed: tuple[int, str] = (0, "")
        self._day_reported = -1
        self._weights_lock = threading.Lock()  # an apply and the periodic sync set the queue's weights in turn
        self._flight_lock = threading.Lock()
        self._admitting = ThreadPoolExecutor(max_workers=settings.admission_threads, thread_name_prefix="aisched-admit")
        self._in_flight: dict[str, tuple[int, int]] = {}  # credential id -> (runs, body bytes) accepted, not ended
        self._stack = ExitStack()
        self._lost_at: float | None = None  # when the Dask scheduler stopped answering (None: it answers)
        self._dask_address = dask_address or ""
        try:
            self.key = load_or_make_key(key_path or settings.home / "control.key")
            self.signer = TicketSigner(self.key)
            # Every record it writes is signed: a record in its log that it did not write is told apart.
            self.ledger = Ledger(settings.ledger(), lease_seconds=settings.hold_lease_seconds, on_alert=emit_budget_alert,
                                 signer=self.signer.sign)
            self._stack.callback(self.ledger.close)
            self.state = AuthorityState(self.ledger, trusted=[self.signer.public_key])
            self.state.refresh()
            self.cluster: LocalGPUCluster | None = None
            from distributed import Client

            # Only the control plane holds the cluster's client certificate: no other process can connect.
            tls = ClusterTLS.load_or_create(dask_tls or settings.home / "tls") if dask_tls or not dask_address else None
            if dask_address:
                security = tls.security("client") if tls is not None else None
                self.client = Client(dask_address, set_as_default=False, security=security)
            else:
                assert tls is not None
                # Its scheduler in a process of its own: a busy .map() must not starve the plane's client's loop.
                self.cluster = LocalGPUCluster(declared=declared, trusted_keys=[self.signer.public_key.hex()], tls=tls,
                                               scheduler_process=True)
                self._stack.callback(self.cluster.close)
                self.client = Client(self.cluster.scheduler_address, set_as_default=False,
                                     security=tls.security("client"))
            self._stack.callback(self.client.close)
            self._dask_address = self.client.scheduler.address
            # Dask's client reconnects for `timeout` (30 s) and then closes for good; the plane keeps trying.
            self.client._timeout = settings.scheduler_reconnect_seconds
            install_registry(self.client)
            install_limits(self.client)  # per-model call limits, where the queue lives
            self.queue = queue
            if queue:
                from dask_gpu import install_queue

                install_queue(self.client, weights=self.tenant_weights())
            self.dispatcher = Dispatcher(self.client, self.signer, self.ledger, self.state, settings, queue=queue)
            self._stack.callback(self.dispatcher.warm.close)  # before the client closes: bodies end, idle time settled
            self.admitter = Admitter(self.ledger, self.state, self.dispatcher.inventories, self.replica)
            self.approvals = ApprovalBook(self.ledger, self.state, base_url)
            self.admitter.existing_approval = self.approvals.find
            self.admitter.before_asking = self._check_open_approvals
            # A completed call's result token is kept sealed under a key only the plane's key file gives.
            self.calls = CallBook(self.ledger, self.replica, base_url,
                                  seal=TokenSeal(derived_secret(self.key, TOKEN_PURPOSE)))
            self.outcomes = OutcomeBook(settings.session_lease_seconds, on_abandoned=self.abandon,
                                        on_gone=self.dispatcher.warm.callers_gone)
            chores = [(settings.drift_seconds, self.record_drift),
                      (min(settings.hold_lease_seconds / 3, 30.0), self.approvals.tend),  # holds of waiting requests
                      (settings.day_report_seconds, self.publish_day_report),
                      (min(settings.session_lease_seconds / 3, 5.0), self.outcomes.expire)]
            if checkpoint_dir is not None:
                chores.append((settings.checkpoint_seconds, self.checkpoint_if_moved))
            if queue:  # a scheduler that restarted (its queue installed afresh by its preload) gets the weights back
                chores.append((settings.queue_sync_seconds, self._set_queue_weights))
            chores.append((1.0, self.watch_scheduler))
            self.watcher = Watcher(self.dispatcher, self.state, settings, heartbeat=self.calls.heartbeat,
                                   periodic=chores)
            self.watcher.start()
            self._stack.callback(self.watcher.close)
            self._stack.callback(self._admitting.shutdown, wait=False)
        except BaseException:
            self._stack.close()
            raise

    def close(self) -> None:
        self._stack.close()

    @property
    def public_key(self) -> str:
        return self.signer.public_key.hex()

    # -- identity -------------------------------------------------------------------------
    def authenticate(self, token: str | None, *roles: Role) -> Credential:
        if not token:
            raise Unauthorized("no credential: send `Authorization: Bearer <token>` (AISCHED_TOKEN for flows, "
                               "AISCHED_OPERATOR_TOKEN for operators)")
        parsed = parse_token(token)
        if parsed is None:
            raise Unauthorized("the credential is not an aisched token (ais_<id>_<secret>)")
        snap = self.state.snapshot
        cred = snap.credentials.get(parsed[0])
        if cred is None:
            cred = self.state.refresh().credentials.get(parsed[0])
        if cred is None or not cred.matches(token):
            raise Unauthorized("unknown or revoked credential. Fix: an operator issues one with `aisched credentials issue`")
        if roles and cred.role not in roles:
            raise Unauthorized(f"a {cred.role} credential may not do this (needs {' or '.join(roles)}). "
                               f"Fix: {role_fix(roles)}", 403)
        return cred

    def issue(self, by: str, *, principal: str, tenant: str, role: Role, **bindings: str | None) -> tuple[str, Credential]:
        """A new credential; its hash (never the token) becomes an evidence record.

        Checked first, so a mistake shows here and not at the first run: the principal and tenant are names
        the books can carry, and every configuration it is bound to is applied on this control plane."""
        check_principal("principal", principal, exact=role != "operator")
        check_principal("tenant", tenant, exact=False)
        self._check_bindings(bindings)
        token, cred = new_credential(principal=principal, tenant=tenant, role=role, created_by=by, **bindings)
        records.record(self.ledger, records.CredentialIssued(credential=cred, by=by), principal=by)
        self.state.refresh()
        return token, cred

    def _check_bindings(self, bindings: dict[str, str | None]) -> None:
        """Every configuration a credential names (authority, budget, policy, cluster) is applied here."""
        snap = self.state.refresh()
        for kind in ("authority", "budget", "policy", "cluster"):
            name = bindings.get(kind)
            if name is None or snap.config(kind, name) is not None:
                continue
            applied = sorted(n for k, n in snap.configs if k == kind)
            known = f" (applied: {', '.join(applied)})" if applied else " (none is applied yet)"
            raise InvalidConfig(kind, name, f"no {kind} {shown(name)} is applied on this control plane{known}",
                                f"apply it first (aisched apply --{kind} {shown(name, 40)}), or name an applied one "
                                f"with --{kind}")

    def _check_open_approvals(self, cred: Credential) -> None:
        """Refuse one more request for a person from a credential that has AISCHED_MAX_OPEN_APPROVALS open (429),
        before anything is held for it: one flow cannot fill the approvers' queue (and hold budget) without end."""
        import sqlalchemy as sa

        from aisched_prefect.control.approvals import approvals as table

        limit = self.settings.max_open_approvals
        with self.ledger.reader.connect() as conn:
            rows = conn.execute(sa.select(table.c.admission).where(
                (table.c.status == "pending") & (table.c.principal == cred.principal)
                & (table.c.deadline > time.time()))).scalars().all()
        mine = sum(1 for adm in rows if (adm if isinstance(adm, dict) else json.loads(adm)).get("credential") == cred.id)
        if mine >= limit:
            raise TooManyOpenApprovals(cred.principal, mine, limit)

    def revoke_credential(self, by: str, credential_id: str) -> None:
        if credential_id not in self.state.refresh().credentials:
            raise AISchedError(f"no credential {credential_id!r}")
        records.record(self.ledger, records.CredentialRevoked(id=credential_id, by=by), principal=by)
        self.state.refresh()

    def bootstrap_operator(self, path: Path) -> str | None:
        """The first operator credential of a fresh control plane, written 0600 to `path`; None if one exists."""
        if any(c.role == "operator" and not c.revoked for c in self.state.refresh().credentials.values()):
            return None
        token, _ = self.issue("bootstrap", principal="operator", tenant="operators", role="operator")
        write_private(path, token.encode(), force=True)
        return token

    # -- configuration ----------------------------------------------------------------------
    def apply(self, by: str, kind: str, name: str, body: dict[str, Any]) -> Applied:
        """Apply a block's content: from now on it is what admission reads. Same content: nothing changes.

        Everything is checked before anything is recorded (the name, the content, and for a budget the
        accounts the ledger must book), and the configuration record and the limits it sets are written in
        one transaction: a refused change leaves nothing behind."""
        cls = CONFIG_KINDS.get(kind)
        if cls is None:
            raise InvalidConfig("kind", kind, f"apply one of {', '.join(sorted(CONFIG_KINDS))}",
                                "name the block's kind in the URL: /v1/config/<kind>/<name>")
        check_config_name(kind, name)
        try:
            model = cls.model_validate(body)
        except Exception as exc:
            raise AISchedError(f"{kind} {name!r} is not valid: {exc}") from None
        if kind == "authority":
            problems = model.problems()
            if problems:
                raise AISchedError(f"authority {name!r} cannot be applied: " + "; ".join(problems))
        canonical = json.loads(model.model_dump_json(include=set(cls.model_fields)))
        digest_ = content_digest(canonical)
        snap = self.state.refresh()
        current = snap.config(kind, name)
        if self.state.broken is not None:
            raise AISchedError(f"the evidence log is broken ({self.state.broken}): nothing is applied until it is "
                               "restored. Fix: investigate the database (aisched evidence verify --checkpoint DIR)")
        if current is not None and current.digest == digest_:
            return current
        version = (current.version if current else 0) + 1
        item = records.ConfigApplied(config_kind=kind, name=name, version=version, digest=digest_, body=canonical, by=by)
        limits: list[tuple[list[Any], int]] = []
        if kind in ("budget", "authority"):  # a lowered limit applies to the next reservation, in every process
            configs = {**snap.configs, (kind, name): Applied(kind=kind, name=name, version=version, digest=digest_,
                                                             seq=-1, body=canonical, model=model)}
            limits = self._limit_sets(configs, checked=(kind, name) if kind == "budget" else None)
        self.ledger.record_with_limits(item.kind, records._wire(item), limits, by=by)
        applied = self.state.refresh().config(kind, name)
        assert applied is not None
        if kind == "cluster":  # its tenant weights reach the queue now (model limits are read per call)
            self._set_queue_weights()
        return applied

    def scheduler_state(self) -> dict[str, Any]:
        """Whether the Dask scheduler answers now, and since when it has not (for /v1/health and doctor)."""
        running = self.client.status == "running" and self.client.scheduler is not None
        return {"connected": running, "address": self._dask_address,
                **({} if running or self._lost_at is None else {"lost_for_seconds": round(time.time() - self._lost_at, 1)})}

    def watch_scheduler(self) -> None:
        """Notice a lost and a regained scheduler: a regained one (maybe a fresh process) gets the registry, the
        limits, the queue and its weights again, and every run that waited in the old queue is queued again."""
        running = self.client.status == "running"
        if not running:
            if self._lost_at is None:
                self._lost_at = time.time()
                logger.error("lost the Dask scheduler at %s: reconnecting (runs on it fail with SchedulerLost; "
                             "waiting runs are queued again once it is back)", self._dask_address)
            return
        if self._lost_at is None:
            return
        logger.warning("the Dask scheduler at %s is back after %.0fs: installing the queue again and re-queueing "
                       "%d waiting run(s)", self._dask_address, time.time() - self._lost_at, self.dispatcher.waiting())
        try:
            install_registry(self.client)
            install_limits(self.client)
            if self.queue:
                self._set_queue_weights()
            self.dispatcher.resubscribe()
            self.dispatcher.reenter_waiting()
            self._lost_at = None
        except Exception:  # tried again at the next chore
            logger.exception("could not set the scheduler up again; retrying")

    def tenant_weights(self) -> dict[str, float]:
        """The queue's tenant weights: every applied ClusterBlock's `tenant_weights`, the latest applied winning
        where two name the same tenant (a tenant none names weighs 1)."""
        out: dict[str, float] = {}
        clusters = [a for (k, _), a in self.state.snapshot.configs.items() if k == "cluster"]
        for applied in sorted(clusters, key=lambda a: a.seq):
            out.update(applied.model.tenant_weights)
        return out

    def _set_queue_weights(self) -> None:
        if not self.queue:
            return
        from dask_gpu import install_queue

        try:
            with self._weights_lock:  # read and sent together: a sync that read before an apply cannot land after it
                install_queue(self.client, weights=self.tenant_weights())
        except Exception:
            logger.exception("could not set the tenant weights on the cluster's queue")

    def _limit_sets(self, configs: dict[tuple[str, str], Applied],
                    checked: tuple[str, str] | None = None) -> list[tuple[list[Any], int]]:
        """Each applied budget's limit lines and the version they carry: its own plus the newest authority's (see
        stages.config_version). What an apply tells the ledger, in the transaction that records it. Grant-share
        accounts (`<account>#<grant>`) are set by the lines of the runs that use them.

        The budget `checked` (one being applied) must be bookable: InvalidConfig names its account otherwise.
        Any other that cannot be booked (a record from before names were checked) is left out and logged: one
        bad record in the log never blocks the applies that follow it."""
        from aisched_prefect.ledger.limits import check_line

        authorities = [a.version for (k, _), a in configs.items() if k == "authority"]
        now = self.ledger.now()
        out: list[tuple[list[Any], int]] = []
        for (kind, name), budget in sorted(configs.items()):
            if kind != "budget":
                continue
            version = budget.version + max(authorities, default=0)
            try:
                lines = budget.model.limit_lines(name, now, config_version=version)
                for i, line in enumerate(lines):
                    check_line(line, f"budget {name!r} account {i}")
            except (ValueError, InvalidLedgerInput) as exc:
                if (kind, name) == checked:
                    why = " ".join(str(exc).split()[:40])  # one line: pydantic's errors span several
                    raise InvalidConfig("budget", name, f"the ledger cannot book its accounts ({why})",
                                        "shorten the budget's name or its limits' names (an account, "
                                        "<budget>/<limit>, is at most 200 characters)") from None
                logger.warning("budget %r (applied version %s) cannot be booked and is left out of the limits: %s",
                               name[:60], budget.version, exc)
                continue
            out.append((lines, version))
        return out

    # -- grants -----------------------------------------------------------------------------
    def delegate(self, caller: Credential, parent: str, *, id: str, principal: str, authority: str | None = None,
                 **dimensions: Any) -> Grant:
        """Delegate from `parent` to `principal`: only a holder of `parent` (or an operator) may.

        A flow's or approver's credential delegates under the authority it is bound to; an
        operator names the authority (`authority=`).
        """
        from aisched_prefect.control import stages

        snap = self.state.refresh()
        name = authority if caller.role == "operator" else caller.authority
        applied = snap.config("authority", name)
        if applied is None:
            raise DelegationRefused("authority", f"no authority {name!r} is applied on this control plane")
        authority_ = applied
        try:
            if id in snap.index(authority_).roots or id in snap.delegated_in(authority_):
                raise DelegationRefused("id", f"a grant {id!r} already exists: choose another id")
            chain = stages.chain_of(snap, authority_, parent)
            if caller.role != "operator" and parent not in {g.id for g in snap.grants_of(authority_, caller.principal)}:
                raise DelegationRefused("by", f"{caller.principal!r} does not hold grant {parent!r}: only its holder "
                                        "(or an operator) may delegate from it")
            child = delegate(chain[-1], id=id, principal=principal, **dimensions)
        except (DelegationRefused, ChainBroken) as exc:
            self.ledger.record("delegation-refused", {
                "parent": parent, "grant": id, "to": principal, "by": caller.principal, "reason": str(exc),
                "dimension": getattr(exc, "dimension", "chain"),
                "asked": {k: v.isoformat() if hasattr(v, "isoformat") else v for k, v in dimensions.items()},
            }, principal=caller.principal)
            raise
        records.record(self.ledger, records.Delegation(grant=child, by=caller.principal, authority=authority_.name),
                       principal=caller.principal)
        self.state.refresh()
        return child

    def revoke(self, caller: Credential, grant_id: str, reason: str, authority: str | None = None) -> bool:
        """Revoke a grant and everything below it: an operator, or the holder of a grant above it, may.

        Grant ids are unique within one authority, so a revocation names its authority: the
        caller's own, or (operators) the one that holds the grant (`authority=` where several do).
        """
        from aisched_prefect.control import stages

        snap = self.state.refresh()
        if caller.role == "operator":
            holders = [a for (k, n), a in snap.configs.items() if k == "authority" and (authority is None or n == authority)
                       and (grant_id in snap.index(a).roots or _roots_in(snap, a, grant_id))]
            if len(holders) != 1:
                raise AISchedError(f"grant {grant_id!r} is in {len(holders)} applied authorities"
                                   f"{' (' + ', '.join(a.name for a in holders) + ')' if holders else ''}. "
                                   "Fix: name one with authority=")
            applied = holders[0]
        else:
            applied = snap.config("authority", caller.authority)
            held = {g.id for g in snap.grants_of(applied, caller.principal)} if applied else set()
            try:
                ancestors = {g.id for g in stages.chain_of(snap, applied, grant_id)[:-1]} if applied else set()
            except ChainBroken:
                ancestors = set()
            if applied is None or not held & ancestors:
                raise Unauthorized(f"{caller.principal!r} holds no grant above {grant_id!r}: only an operator or the "
                                   "grant's delegator may revoke it", 403)
        if (applied.name, grant_id) in snap.revoked:
            return False
        records.record(self.ledger, records.Revocation(grant=grant_id, authority=applied.name, by=caller.principal,
                                                       reason=reason), principal=caller.principal)
        self.state.refresh()
        return True

    # -- calls --------------------------------------------------------------------------------
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
        if not self.outcomes.owns(session, _who(cred)):
            raise Unauthorized("this session belongs to another principal: a runner chooses a fresh random one", 403)
        def one(item: tuple[CallMeta, tuple[bytes, bytes]]) -> Reply:
            try:
                return self.submit(cred, item[0], item[1], session)[0]
            except Busy as exc:
                return Reply(status="failed", error_type="busy", error_message=str(exc))
            except (AISchedError, ValueError) as exc:
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
        request = AIRequest.build(**meta.request)
        fn_bytes, args_bytes = body
        if not fn_bytes:
            raise InvalidAIRequest("the call carries no function: it is malformed")
        self._check_in_flight(cred, len(fn_bytes) + len(args_bytes))
        payload_digest = _digest_parts(fn_bytes, args_bytes)
        args_digest = digest(args_bytes)
        function_digest = digest(fn_bytes)  # the code identity, from the bytes received (never unpickled)
        _check_shipped(fn_bytes, meta.code_digest)
        owner = self.calls.owner(meta.flow_run_id, _who(cred))
        if owner != _who(cred):
            raise Unauthorized(f"flow run {meta.flow_run_id} belongs to {owner!r}: a flow files its calls under its "
                               "own flow run", 403)
        self._own_task_run(cred, meta.task_run_id)
        key = call_key(_who(cred), meta.task_run_id, meta.attempt, meta.admission)
        claim, row = self.calls.claim(key)
        filed: list[str] = []  # the admission filed with the call in the transaction that took its holds
        if claim == "busy":
            if row.replica == self.replica and session is not None and self.dispatcher.has_call(key):
                self.outcomes.expect(key, session, _who(cred))  # a flow re-attaching to a run it already submitted
                return Reply(status="accepted", key=key), b""
            raise Busy(f"this call is running on replica {row.replica}: wait for it (the client retries)")
        if claim == "done" and session is not None and self.outcomes.holds(session, key):
            return Reply(status="accepted", key=key), b""  # sent again after a cut: its outcome is on the stream
        if claim == "done":  # its reply was lost in transit (or this replica restarted): never run it twice
            stored, why = self.calls.reply(key, row.reply)
            old = Reply.model_validate(stored)
            if old.status != "completed" or old.result_ref is not None:  # a large result: still on its worker
                return old.model_copy(update={"key": key}), b""
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

                admission = self._admit(cred, meta, request, payload_digest, args_digest, file_with_holds,
                                        function_digest)
        except _Early as early:
            self.calls.done(key, early.reply.model_dump(mode="json"))
            return early.reply.model_copy(update={"key": key}), b""
        except CallTakenOver as exc:  # nothing of this admission committed: the call is the other replica's
            raise Busy(f"{exc}: wait for it (the client retries)") from None
        except BaseException:
            self.calls.release(key)
            raise
        if admission.id not in filed:  # taken over, or continued after an approval: filed here
            self.calls.admitted(key, admission.model_dump(mode="json"))
        self.outcomes.expect(key, session, _who(cred))
        size = len(fn_bytes) + len(args_bytes)
        with self._flight_lock:
            runs, held = self._in_flight.get(cred.id, (0, 0))
            self._in_flight[cred.id] = (runs + 1, held + size)
        self.dispatcher.launch(admission, BodyParts(fn_bytes, args_bytes, tuple(meta.modules)), self.admitter,
                               lambda reply, out: self._finished(key, reply, out, cred.id, size), call_key=key)
        return Reply(status="accepted", key=key, admission=admission.id), b""

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
            self.calls.done(key, reply.model_dump(mode="json"))
        except Exception:  # the outcome still reaches its caller; the call book is retried by a takeover
            logger.exception("could not file the reply of call %s", key)
        self.outcomes.put(key, reply, out)

    def result_lost(self, cred: Credential, key: str, reason: str) -> dict[str, Any]:
        """A flow could not fetch its completed call's large result from the worker that kept it (every attempt failed:
        404, refused, cut, timed out). The run stays settled as it ran (charged); one `result-lost` record about its
        admission says so, naming the worker (as the call book has it) and the flow's reason. Reported again: the
        record already filed."""
        if cred.role != "flow":
            raise Unauthorized("only a flow's credential reports its lost results", 403)
        row = self.calls.get(key) if callers_key(_who(cred), key) else None
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

    def abandon(self, keys: list[str]) -> None:
        """A flow process stopped polling for its outcomes: its runs still waiting in the queue are taken out."""
        stopped = self.dispatcher.abandon(set(keys))
        if stopped:
            logger.warning("a flow process went away: %d of its waiting AI task runs leave the queue", stopped)

    def _admit(self, cred: Credential, meta: CallMeta, request: AIRequest, payload_digest: str,
               args_digest: str, on_admitted: Callable[[Any, Admission], None], function_digest: str) -> Admission:
        """A new admission (`on_admitted` files it with the call in the transaction that holds its budget), or the
        one an approval allows; an outcome that ends the call here raises _Early."""
        try:
            if meta.admission is not None:
                return self._continue(cred, meta, payload_digest)
            return self.admitter.admit(cred, meta, request, payload_digest, args_digest, meta.approver, on_admitted,
                                       function_digest)
        except AdmissionDenied as exc:
            raise _Early(denied(exc.stage, exc.reason, exc.fix)) from None
        except ApprovalNeeded as need:
            raise _Early(self._ask(need)) from None

    def _ask(self, need: ApprovalNeeded) -> Reply:
        adm = need.admission
        if need.existing:  # the re-run of a suspended deployment run: its request holds its answer
            return Reply(status="approval-pending", admission=need.approval_id,
                         approval=self.approvals.view(need.approval_id))
        rec = self.ledger.records_about(adm.task_run_id)
        payload = next(r.payload for r in reversed(rec) if r.kind == "approval-requested" and str(r.seq) == adm.id)
        currency = self.dispatcher._bound(adm).budget.model.currency
        view = self.approvals.create(adm, payload, currency)
        self._announce("aisched.approval.requested", view)
        return Reply(status="approval-pending", admission=view.id, approval=view)

    def _continue(self, cred: Credential, meta: CallMeta, payload_digest: str) -> Admission:
        """The one execution an approval allows, after a fresh authority check; the caller must be the requester."""
        assert meta.admission is not None
        admission = self.approvals.admission(meta.admission)
        if not _owns(cred, admission):
            raise Unauthorized("this approval belongs to another principal", 403)
        if admission.payload_digest != payload_digest:
            raise AdmissionDenied("approval", "the call's body or arguments differ from what was approved",
                                  "run the flow again to ask for this call")
        view, admission = self.approvals.consume(meta.admission)
        admission = admission.model_copy(update={"task_run_id": meta.task_run_id})
        snap = self.state.refresh()
        from aisched_prefect.control import stages

        try:
            stages.authority(snap, stages.configuration(snap, cred), admission.facts, admission.chain[-1])
        except AdmissionDenied as exc:  # approved, but its authority ended while it waited: denied, and recorded
            self.dispatcher.settle(admission, None, {"outcome": "revoked-while-waiting", "approval": view.id})
            raise self.admitter.deny(exc.stage, exc.reason, exc.fix, {
                "task": admission.task_name, "flow": admission.flow_name, "tenant": admission.tenant,
                "request": admission.request.model_dump(mode="json"), "chain": admission.chain,
                "approval": view.id, "approved_by": view.approved_by}, admission.ids) from None
        if self.approvals._row(meta.admission).suspended:  # its holds were released while it waited: hold again
            admission = self.admitter.readmit(admission, "approved after suspension")
        self.ledger.record("admission", {"task": admission.task_name, "flow": admission.flow_name,
                                         "tenant": admission.tenant, "request": admission.request.model_dump(mode="json"),
                                         "approval": ", ".join(view.approved_by), "approval_id": view.id,
                                         "holds": [h.model_dump() for h in admission.holds], "chain": admission.chain,
                                         "grant": admission.chain[-1]}, **admission.ids)
        return admission

    def _announce(self, event: str, view: ApprovalView) -> None:
        """A Prefect event for every approval request, so automations can notify people (when Prefect is reachable)."""
        if not os.environ.get("PREFECT_API_URL"):
            return
        try:
            from prefect.events import emit_event

            emit_event(event=event, resource={"prefect.resource.id": f"aisched.approval.{view.id}",
                                              "prefect.resource.name": view.task_name, "aisched.principal": view.principal,
                                              "aisched.rule": str(view.rule)},
                       payload={"digest": view.digest, "est_cost": view.est_cost, "url": view.url})
        except Exception:
            logger.exception("could not emit %s", event)

    # -- approvals ----------------------------------------------------------------------------
    def approval(self, caller: Credential, approval_id: str, wait: float = 0.0) -> ApprovalView:
        deadline = time.monotonic() + min(wait, self.settings.approval_wait_seconds)
        while True:
            view = self.approvals.view(approval_id)
            if caller.role == "flow" and not _owns(caller, self.approvals.admission(approval_id)):
                raise Unauthorized("this approval belongs to another principal", 403)
            if view.status not in ("pending", "suspended") or time.monotonic() >= deadline:
                return view
            time.sleep(0.2)

    def answer(self, caller: Credential | None, approval_id: str, decision: ApprovalDecision,
               items: list[str] | tuple[str, ...] = ()) -> ApprovalView:
        """Count an answer to one request, or to it and `items` together (one flow run's requests, a `.map()`):
        every item is proved first, so a batch counts whole or not at all."""
        ids = list(dict.fromkeys([approval_id, *items]))
        batch = ids if len(ids) > 1 else None
        if batch is not None:
            first = self.approvals.view(approval_id)
            for i in ids[1:]:
                other = self.approvals.view(i)
                if (other.flow_run_id, other.principal) != (first.flow_run_id, first.principal):
                    raise ApprovalError(f"approval {i} is not a request of flow run {first.flow_run_id}: one answer "
                                        "covers requests of one flow run", 400)
            for i in ids:
                self.approvals.check(i, decision, caller, batch)
        views = [self.approvals.answer(i, decision, caller, batch) for i in ids]
        decided = [v for v in views if v.status in ("approved", "rejected")]
        for view in decided:
            self._announce("aisched.approval.decided", view)
        if decided and len(decided) == len(views):  # one resume per flow run, once all are decided
            self._resume_if_suspended(decided[0], decision)
        return views[0]

    def _resume_if_suspended(self, view: ApprovalView, decision: ApprovalDecision) -> None:
        """A suspended deployment run waits for Prefect to resume it: do it, now that the answer is recorded."""
        if not self.approvals._row(view.id).suspended or not os.environ.get("PREFECT_API_URL"):
            return
        try:
            from prefect.flow_runs import resume_flow_run

            resume_flow_run(view.flow_run_id, run_input={"approve": view.status == "approved",
                                                         "approver": view.decided_by or "", "reason": decision.reason})
        except Exception:
            logger.exception("could not resume suspended flow run %s", view.flow_run_id)

    # -- the cluster ----------------------------------------------------------------------------
    @property
    def version(self) -> str:
        from importlib.metadata import version

        return version("aisched-prefect")

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

    # -- evidence -----------------------------------------------------------------------------
    def record_drift(self) -> list[dict[str, Any]]:
        """Blocks edited in Prefect but not applied: recorded once per content, and ignored.

        A flow that rewrites its AuthorityBlock through Prefect's API changes what the
        UI shows, not what is enforced; the record says so, and an operator sees it.
        """
        if not os.environ.get("PREFECT_API_URL"):
            return []
        from aisched_prefect.control.state import CONFIG_KINDS, block_body

        snap = self.state.refresh()
        found = []
        for (kind, name), applied in snap.configs.items():
            try:
                body = block_body(CONFIG_KINDS[kind].load(name))
            except Exception:  # no such block in Prefect (applied from elsewhere), or Prefect is down
                continue
            canonical = json.loads(CONFIG_KINDS[kind].model_validate(body).model_dump_json(
                include=set(CONFIG_KINDS[kind].model_fields)))
            edited = content_digest(canonical)
            key = (kind, name, edited)
            if edited == applied.digest or key in self._drift_seen:
                continue
            self._drift_seen.add(key)
            item = records.ConfigDrift(config_kind=kind, name=name, applied_version=applied.version,
                                       applied_digest=applied.digest, block_digest=edited)
            records.record(self.ledger, item)
            logger.warning("%s block %r was edited in Prefect but not applied: ignored (aisched apply --%s %s)",
                           kind, name, kind, name)
            found.append(item.model_dump())
        return found

    def publish_day_report(self) -> None:
        """The day's usage artifact, on a schedule (it reads the whole day), when anything new was recorded."""
        if not os.environ.get("PREFECT_API_URL"):
            return
        import sqlalchemy as sa

        from aisched_prefect.ledger import chain_head
        from aisched_prefect.usage_report import publish_day_artifact

        with self.ledger.reader.connect() as conn:
            head = conn.execute(sa.select(chain_head.c.seq)).scalar() or 0
        if head != self._day_reported:
            publish_day_artifact(self.ledger)
            self._day_reported = head

    def checkpoint_if_moved(self) -> None:
        import sqlalchemy as sa

        from aisched_prefect.ledger import chain_head

        with self.ledger.reader.connect() as conn:
            head = conn.execute(sa.select(chain_head.c.seq)).scalar() or 0
        if head != self._checkpointed:
            self._checkpointed = self.checkpoint()["seq"]

    def _last_signed(self) -> tuple[int, str]:
        """The newest head this control plane signed: its published checkpoint (outside the database), else what
        this process signed last, else the start of the log."""
        if self.checkpoint_dir is not None and (self.checkpoint_dir / "latest.json").exists():
            data = json.loads((self.checkpoint_dir / "latest.json").read_text())
            if data.get("public_key") == self.public_key:
                return max((int(data["seq"]), str(data["hash"])), self._signed)
        return self._signed

    def checkpoint(self) -> dict[str, Any]:
        """Sign the head of the log and publish it outside the database (when a directory is configured).

        Only a log that still extends the last signed head is signed: a rewritten history (even one
        rechained so that it verifies on its own) is refused here, loudly, instead of being blessed.
        """
        import sqlalchemy as sa

        from aisched_prefect.evidence import extends
        from aisched_prefect.ledger import evidence

        seq, hash_ = self._last_signed()
        with self.ledger.reader.connect() as conn:
            rows = conn.execute(sa.select(evidence).where(evidence.c.seq >= max(seq, 1)).order_by(evidence.c.seq)).all()
        from aisched_prefect.evidence import EvidenceRecord

        problem = extends([EvidenceRecord.model_construct(**r._mapping) for r in rows], seq, hash_)
        if problem is not None:
            logger.critical("NOT signing the evidence log: %s", problem)
            raise AISchedError(f"the evidence log no longer extends the last signed checkpoint: {problem}. Fix: "
                               "investigate the database (aisched evidence verify --checkpoint DIR), restore it, "
                               "then sign again")
        cp = self.ledger.checkpoint(self.key)
        self._signed = max(self._signed, (cp.seq, cp.hash))
        out = {**cp.model_dump(), "public_key": self.public_key}
        if self.checkpoint_dir is not None:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            body = json.dumps(out, sort_keys=True).encode()
            (self.checkpoint_dir / f"checkpoint-{cp.seq:012d}.json").write_bytes(body)
            (self.checkpoint_dir / "latest.json").write_bytes(body)
        return out

    def publish_usage(self, caller: Credential, flow_run_id: str) -> dict[str, Any]:
        """Publish the flow run's usage artifact (the ledger is here, not in the flow process); it reads only that
        flow run's records, so a flow run's end costs the same however much the day holds."""
        self._own_flow_run(caller, flow_run_id)
        if not os.environ.get("PREFECT_API_URL"):
            return {"published": [], "reason": "this control plane has no PREFECT_API_URL"}
        from aisched_prefect.usage_report import publish_flow_run_artifact

        try:
            return {"published": [publish_flow_run_artifact(self.ledger, flow_run_id)]}
        except Exception as exc:  # said to the caller, who logs it; never fails its flow
            logger.exception("could not publish the usage report artifacts of flow run %s", flow_run_id)
            err = AISchedError(f"the control plane could not publish them to Prefect at {os.environ['PREFECT_API_URL']} "
                               f"({type(exc).__name__}: {exc})")
            err.status = 502  # type: ignore[attr-defined]
            raise err from None

    def flow_run_records(self, caller: Credential, flow_run_id: str) -> list[Any]:
        self._own_flow_run(caller, flow_run_id)
        return self.ledger.records(flow_run_id)

    def _own_task_run(self, caller: Credential, task_run_id: str) -> None:
        """A call under a task run id another principal called under is refused: its replies are that principal's."""
        owner = self.calls.task_owner(task_run_id, _who(caller))
        if owner != _who(caller):
            raise Unauthorized(f"task run {task_run_id} belongs to another principal: a flow files its calls under "
                               "its own task runs", 403)

    def _own_flow_run(self, caller: Credential, flow_run_id: str) -> None:
        """A flow reads and publishes only the flow runs it made its calls under (operators: any)."""
        if caller.role == "operator":
            return
        owner = self.calls.owner_of(flow_run_id)
        if owner != _who(caller):
            raise Unauthorized(f"{caller.principal!r} ran nothing in flow run {flow_run_id}", 403)

