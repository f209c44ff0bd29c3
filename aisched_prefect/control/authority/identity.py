"""Who is calling: credentials an operator issued, stored as hashes, proved by a bearer token.

A token is `ais_<id>_<secret>`; the control plane keeps only sha256(secret),
in the evidence chain (so a credential nobody issued through the control plane
cannot appear by editing a table). A flow's principal, tenant and the
configuration it runs under are what its credential says, never what the flow
passes.

>>> token, cred = new_credential(principal="team-a/nightly", tenant="team-a", role="flow", created_by="op")
>>> parse_token(token)[0] == cred.id and cred.matches(token)
True
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["flow", "operator", "approver"]
_TOKEN = re.compile(r"^ais_([0-9a-f]{16})_([A-Za-z0-9_-]{20,})$")


class Credential(BaseModel):
    """What a token proves. Issued by an operator; `bindings` name the applied configuration a flow runs under."""

    model_config = ConfigDict(frozen=True)

    id: str
    secret_sha256: str
    principal: str = Field(min_length=1)
    tenant: str = Field(min_length=1)
    role: Role
    authority: str | None = None
    budget: str | None = None
    policy: str | None = None
    cluster: str | None = None
    created_by: str
    revoked: bool = False
    expires_at: float | None = None  # epoch seconds after which it proves nothing (None: until revoked)

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def matches(self, token: str) -> bool:
        parsed = parse_token(token)
        return (parsed is not None and parsed[0] == self.id and not self.revoked
                and hmac.compare_digest(hashlib.sha256(parsed[1].encode()).hexdigest(), self.secret_sha256))

    def public(self) -> dict:
        return self.model_dump(exclude={"secret_sha256"})


def parse_token(token: str) -> tuple[str, str] | None:
    m = _TOKEN.match(token.strip())
    return (m.group(1), m.group(2)) if m else None


def new_credential(*, principal: str, tenant: str, role: Role, created_by: str, authority: str | None = None,
                   budget: str | None = None, policy: str | None = None, cluster: str | None = None,
                   expires_at: float | None = None) -> tuple[str, Credential]:
    """A fresh token (shown once) and the credential the control plane keeps for it."""
    cid, secret = secrets.token_hex(8), secrets.token_urlsafe(32)
    cred = Credential(id=cid, secret_sha256=hashlib.sha256(secret.encode()).hexdigest(), principal=principal,
                      tenant=tenant, role=role, authority=authority, budget=budget, policy=policy, cluster=cluster,
                      created_by=created_by, expires_at=expires_at)
    return f"ais_{cid}_{secret}", cred
