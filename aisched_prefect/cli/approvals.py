"""`aisched approvals` (keygen, list, link) and `aisched approve` / `aisched reject`: runs waiting for a person."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Optional

import typer

from aisched_prefect.cli import common
from aisched_prefect.cli.common import ApproverOpt, ForceOpt, KeyOpt, PlaneOpt, TokenOpt, console

if TYPE_CHECKING:
    from aisched_prefect.flow.client import ControlPlaneClient


approvals_app = typer.Typer(help="Runs waiting for a person, and approvers' keys.", no_args_is_help=True)


def _write_keypair(out: str, force: bool = False) -> str:
    """A new Ed25519 key: private half (PEM, 0600) to OUT, public half (PEM) to OUT.pub; returns the public key in hex.

    An existing key is never replaced unless `force`: losing one locks its holder out.
    """
    from pathlib import Path

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

    from aisched_prefect.control.authority.keys import write_private

    key = Ed25519PrivateKey.generate()
    try:
        write_private(Path(out), key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()), force=force)
    except FileExistsError:
        common.fail(f"{out} already exists", "pass --force to replace it (whoever holds the old key can no longer sign)")
    with open(out + ".pub", "wb") as f:
        f.write(key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


@approvals_app.command("keygen")
def approvals_keygen(out: str = typer.Option(..., help="Private key file to write (PEM); keep it to yourself."),
                     force: bool = ForceOpt) -> None:
    """Make an approver's Ed25519 key; put the printed public key in the AuthorityBlock's approver_keys."""
    public = _write_keypair(out, force)
    console.print(f"wrote {out} (private, 0600) and {out}.pub")
    typer.echo(public)


@approvals_app.command("list")
def approvals_list(as_json: bool = typer.Option(False, "--json"), control_plane: Optional[str] = PlaneOpt,
                   token_file: Optional[str] = TokenOpt) -> None:
    """Runs waiting for a person's approval (from the control plane's records), oldest first."""
    rows = common.plane(control_plane, token_file).get("/v1/approvals")
    if as_json:
        for r in rows:
            typer.echo(json.dumps(r, sort_keys=True))
        return
    from aisched_prefect.control.approvals.words import duration_in_words

    now = time.time()
    for r in rows:
        r["id"] = r["id"][:8]  # a unique prefix: approve and reject take it (--json shows whole ids)
        r["left"] = duration_in_words(r["deadline"] - now)  # '11 h 59 min', as the approval page says it
        r["approvals"] = f"{len(r['approved_by'])}/{r['approvals_required']}"
        r["cost"] = f"{r['est_cost']:.4f} {r['currency']}"
        r["digest"] = r["digest"][:16]
    console.print(common.table("waiting for approval", rows, ["id", "task_name", "principal", "rule", "cost", "approvals",
                                                              "left", "status", "digest"]))


@approvals_app.command("link")
def approvals_link(approval_id: str, approver: str = typer.Option(..., "--for", help="The approver the link is for."),
                   control_plane: Optional[str] = PlaneOpt, token_file: Optional[str] = TokenOpt) -> None:
    """A one-time link for one approver to answer one request (operators): hand it to that person alone."""
    typer.echo(common.plane(control_plane, token_file).post(f"/v1/approvals/{approval_id}/links", {"approver": approver})["url"])


def _answer(approval_id: str, approve: bool, approver: Optional[str], reason: str, key: Optional[str],
            control_plane: Optional[str], token_file: Optional[str]) -> None:
    from aisched_prefect.approvals import sign_approval

    plane = common.plane(control_plane, token_file, signed=key is not None)
    body: dict = {"approve": approve, "approver": approver or "", "reason": reason}
    if key is not None:
        if not approver:
            common.fail("a signed answer names its signer", "pass --as NAME (your name in approver_keys)")
        view = plane.get(f"/v1/approvals/{approval_id}") if plane._token else _public_view(plane, approval_id)
        signed_at = time.time()
        body.update(signed_at=signed_at, signature=sign_approval(_load_key(key), view["digest"], approve, approver,
                                                                 reason, signed_at))
    out = plane.post(f"/v1/approvals/{approval_id}/answer", body)
    console.print(f"approved {approval_id}: status {out['status']} (approved by {', '.join(out['approved_by']) or 'nobody yet'})"
                  if approve else f"rejected {approval_id}: the run will not start and its hold is released"
                  if out["status"] == "rejected" else f"your rejection of {approval_id} is recorded (status {out['status']})")


def _public_view(plane: "ControlPlaneClient", approval_id: str) -> dict:
    """What a signed answer signs, without a credential: the request's digest (nothing else about the run)."""
    from aisched_prefect.flow.client import ControlPlaneError

    try:
        return plane.get(f"/v1/approvals/{approval_id}/digest")
    except ControlPlaneError as exc:
        common.fail(f"no approval {approval_id} ({exc})", "see `aisched approvals list`")
        raise


def _load_key(path: str) -> Any:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    with open(path, "rb") as f:
        key = load_pem_private_key(f.read(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        common.fail(f"{path} is not an Ed25519 private key", f"make one: aisched approvals keygen --out {path}")
    return key


def approve(approval_id: str, approver: Optional[str] = ApproverOpt, reason: str = typer.Option("", "--reason"),
            key: Optional[str] = KeyOpt, control_plane: Optional[str] = PlaneOpt,
            token_file: Optional[str] = TokenOpt) -> None:
    """Approve a waiting run (its id from `aisched approvals list`), with your approver token or signed with --key."""
    _answer(approval_id, True, approver, reason, key, control_plane, token_file)


def reject(approval_id: str, approver: Optional[str] = ApproverOpt, reason: str = typer.Option("", "--reason"),
           key: Optional[str] = KeyOpt, control_plane: Optional[str] = PlaneOpt,
           token_file: Optional[str] = TokenOpt) -> None:
    """Reject a waiting run: its hold is released and the task fails with your reason."""
    _answer(approval_id, False, approver, reason, key, control_plane, token_file)
