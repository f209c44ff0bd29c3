"""What an approval binds and how an approver proves an answer: digests, signatures, the pause form.

Prefect's open-source server has no user identity: anyone with API access can
resume a run and type any name. What an approver *can* prove is possession of
a credential the control plane issued, or of a private key: `aisched approve
--key` signs the answer (Ed25519) over the approval's digest, which hashes
exactly what was shown (the call, its arguments, request, cost estimate,
rule) and the one request it answers (`request_digest`). A signature
therefore cannot be forged by the requester and cannot be replayed onto
another, a changed, or a later identical request.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from prefect.input import RunInput
from pydantic import BaseModel, ConfigDict


def approval_digest(*, run_key: str, task_name: str, parameters: str | None, request: dict[str, Any],
                    est_cost: float, currency: str, rule: str | None) -> str:
    """The hash an approval is bound to: what the approver was shown, exactly.

    `run_key` names the task within its flow run (flow run, task key), not the
    task run id: a suspended flow run re-runs from the start with new task run
    ids, and the answer must still bind to the same call. Identical calls of
    one flow run share it; what an approver signs is `request_digest`, which
    binds it to one request.
    """
    body = {"run": run_key, "task": task_name, "parameters": parameters, "request": request,
            "est_cost": round(est_cost, 6), "currency": currency, "rule": rule}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def request_digest(call_digest: str, approval_id: str) -> str:
    """The digest an approver signs: the call's digest bound to one request.

    Identical calls of one flow run (and a call asked again after its approval
    was used) share `approval_digest`; binding the request's id makes a
    signature answer exactly one request, never a later identical one.
    """
    return hashlib.sha256(f"aisched-approval-request/1\n{call_digest}\n{approval_id}".encode()).hexdigest()


def batch_digest(request_digests: list[str]) -> str:
    """What one signed answer to several requests at once signs (a `.map()` asks once): their request digests,
    in any order. One request's batch digest is its own digest."""
    if len(request_digests) == 1:
        return request_digests[0]
    body = "aisched-approval-batch/1\n" + "\n".join(sorted(request_digests))
    return hashlib.sha256(body.encode()).hexdigest()


def _signed_body(digest: str, approve: bool, approver: str, reason: str, signed_at: float) -> bytes:
    body = {"digest": digest, "approve": approve, "approver": approver, "reason": reason, "signed_at": repr(float(signed_at))}
    return b"aisched-approval/1\n" + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def public_key_hex(key: Ed25519PrivateKey) -> str:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def sign_approval(key: Ed25519PrivateKey, digest: str, approve: bool, approver: str, reason: str,
                  signed_at: float) -> str:
    """The signature `aisched approve` attaches to an answer."""
    return key.sign(_signed_body(digest, approve, approver, reason, signed_at)).hex()


def signature_valid(public_hex: str, digest: str, decision: ApprovalDecision) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_hex)).verify(
            bytes.fromhex(decision.signature),
            _signed_body(digest, decision.approved, decision.approver, decision.reason, decision.signed_at))
        return True
    except (InvalidSignature, ValueError):
        return False


def call_signature(fn: Any) -> Any:
    """The signature a call of an AI task binds to: a function's, or a callable class's `__call__` (without self)."""
    import inspect

    if isinstance(fn, type):
        sig = inspect.signature(fn.__call__)
        return sig.replace(parameters=list(sig.parameters.values())[1:])
    return inspect.signature(fn)


def parameters_summary(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, str]:
    """Each argument of a call by name, as short text an approver reads (at most 32, each at most 200 characters).

    >>> def train(data, lr=0.1, *, steps=10): ...
    >>> parameters_summary(train, ("s3://bucket/set",), {"steps": 500})
    {'data': "'s3://bucket/set'", 'lr': '0.1', 'steps': '500'}
    """
    import inspect
    import reprlib

    short = reprlib.Repr()
    short.maxstring, short.maxother, short.maxlist, short.maxdict = 120, 120, 8, 8
    try:
        bound = call_signature(fn).bind_partial(*args, **kwargs)
        bound.apply_defaults()
        items = list(bound.arguments.items())
    except (TypeError, ValueError):
        items = [*((f"arg{i}", a) for i, a in enumerate(args)), *kwargs.items()]
    out = {}
    for name, value in items[:32]:
        try:
            text = short.repr(value)
        except Exception:
            text = f"<{type(value).__name__}>"
        out[str(name)[:100]] = text[:200]
    return out


class ApprovalDecision(BaseModel):
    """A decision, who made it, and their signature if they signed it."""

    model_config = ConfigDict(frozen=True)

    approved: bool
    approver: str
    reason: str = ""
    channel: str
    signature: str = ""
    signed_at: float = 0.0


class ApprovalInput(RunInput):
    """The form of a paused run: the request (its description) and the link to the control plane's page, and no
    field to fill in. Prefect cannot tell who typed into a form, so it offers no Approve toggle that would count for
    nothing; the answer that counts is given on the page. Whatever someone sends through Prefect's API anyway is
    kept (`extra="allow"`), so the control plane records it as not counted."""

    model_config = ConfigDict(extra="allow")
