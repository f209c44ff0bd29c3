"""The control plane's signing key and other secrets on disk: the only part of the plane `aisched serve --print-key`
and the CLI's key files need, so they load no Dask, Prefect or SQLAlchemy."""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    load_pem_private_key,
)

from aisched_prefect.errors import AISchedError


def write_private(path: Path, data: bytes, *, force: bool = False) -> None:
    """Write a secret readable by its owner only (0600); never replace one unless told to."""
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists: pass --force to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def load_or_make_key(path: Path) -> Ed25519PrivateKey:
    """The control plane's signing key: made once, kept 0600; replicas share the file."""
    if path.exists():
        key = load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise AISchedError(f"{path} is not an Ed25519 private key. Fix: remove it to make a new one")
        return key
    key = Ed25519PrivateKey.generate()
    write_private(path, key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    return key


def derived_secret(key: Ed25519PrivateKey, purpose: str) -> bytes:
    """A 256-bit secret for one purpose, derived from the signing key (HKDF-SHA256, `purpose` as its info): every
    replica that holds the key file derives the same one, and nothing kept in the database gives it.

    >>> k = Ed25519PrivateKey.generate()
    >>> derived_secret(k, "a") == derived_secret(k, "a") != derived_secret(k, "b"), len(derived_secret(k, "a"))
    (True, 32)
    """
    raw = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=f"aisched/{purpose}".encode()).derive(raw)
