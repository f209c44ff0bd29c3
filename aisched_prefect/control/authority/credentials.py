"""The credentials desk: who a caller is, and the acts that make, end and limit credentials.

Every act of the control plane starts by proving its caller here (`authenticate`): a credential an
operator issued, unrevoked, of a role that may do the act. Issuing checks the names and bindings
first, so a mistake shows when the credential is made, not at its first run. The per-credential
bound on open approval requests is checked here too (admission asks before it holds anything).
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from aisched_prefect.control.authority import records
from aisched_prefect.control.authority.identity import Credential, Role, new_credential, parse_token
from aisched_prefect.control.authority.keys import write_private
from aisched_prefect.control.authority.state import AuthorityState
from aisched_prefect.errors import AISchedError, InvalidConfig, TooManyOpenApprovals, shown
from aisched_prefect.ledger import Ledger
from aisched_prefect.settings import Settings

if TYPE_CHECKING:
    from aisched_prefect.control.admission.record import Admission


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


def who(cred: Credential) -> str:
    """A flow's identity across authorities: one principal name may be issued under several."""
    return f"{cred.authority}:{cred.principal}"


def owns(cred: Credential, adm: Admission) -> bool:
    """Whether `cred` is the caller the admission was made for."""
    return cred.principal == adm.principal and cred.authority == adm.authority


MAX_EXPIRY_SECONDS = 10 * 365 * 86400.0  # the longest expiry an operator may set at issue
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


class Credentials:
    """Proves callers, and issues and revokes credentials (each an evidence record)."""

    def __init__(self, ledger: Ledger, state: AuthorityState, settings: Settings) -> None:
        self.ledger, self.state, self.settings = ledger, state, settings

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
        if cred.expired(time.time()):
            assert cred.expires_at is not None
            when = datetime.fromtimestamp(cred.expires_at, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            raise Unauthorized(f"credential {cred.id} of {cred.principal} expired at {when}. Fix: an operator issues a "
                               "new one (`aisched credentials issue ... --expires-in 30d`)")
        if roles and cred.role not in roles:
            raise Unauthorized(f"a {cred.role} credential may not do this (needs {' or '.join(roles)}). "
                               f"Fix: {role_fix(roles)}", 403)
        return cred

    def issue(self, by: str, *, principal: str, tenant: str, role: Role, expires_in: float | None = None,
              **bindings: str | None) -> tuple[str, Credential]:
        """A new credential; its hash (never the token) becomes an evidence record.

        Checked first, so a mistake shows here and not at the first run: the principal and tenant are names
        the books can carry, every configuration it is bound to is applied on this control plane, and an expiry
        (`expires_in` seconds from now) is a positive number of at most ten years."""
        check_principal("principal", principal, exact=role != "operator")
        check_principal("tenant", tenant, exact=False)
        if expires_in is not None and not (isinstance(expires_in, (int, float)) and 0 < expires_in <= MAX_EXPIRY_SECONDS):
            raise InvalidConfig("expires_in", expires_in, f"an expiry is a number of seconds in (0, "
                                f"{MAX_EXPIRY_SECONDS:.0f}] (ten years)", "--expires-in 30d (or 12h, 90m, 3600), or "
                                "leave it out for a credential that lasts until revoked")
        self._check_bindings(bindings)
        token, cred = new_credential(principal=principal, tenant=tenant, role=role, created_by=by,
                                     expires_at=time.time() + expires_in if expires_in is not None else None, **bindings)
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

    def check_open_approvals(self, cred: Credential) -> None:
        """Refuse one more request for a person from a credential that has AISCHED_MAX_OPEN_APPROVALS open (429),
        before anything is held for it: one flow cannot fill the approvers' queue (and hold budget) without end."""
        import sqlalchemy as sa

        from aisched_prefect.control.approvals.requests import approvals as table

        limit = self.settings.max_open_approvals
        with self.ledger.reader.connect() as conn:
            rows = conn.execute(sa.select(table.c.admission).where(
                (table.c.status == "pending") & (table.c.principal == cred.principal)
                & (table.c.deadline > time.time()))).scalars().all()
        mine = sum(1 for adm in rows if (adm if isinstance(adm, dict) else json.loads(adm)).get("credential") == cred.id)
        if mine >= limit:
            raise TooManyOpenApprovals(cred.principal, mine, limit)

    def revoke(self, by: str, credential_id: str) -> None:
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
