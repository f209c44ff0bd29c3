"""Mutual TLS for a GPU cluster: only holders of a certificate from the cluster's own CA may connect.

Dask trusts every client of a scheduler (`client.run`, `register_plugin` and
`submit` all run code on workers), so the only way to keep untrusted code off
the workers is to keep it from connecting at all. `ClusterTLS.create` makes a
private CA and three certificates signed by it: the scheduler's
(`aisched-scheduler`), the workers' (`aisched-cluster`) and the one trusted
client's, the control plane (`aisched-client`). Dask's TLS requires a peer
certificate on both sides, so a process without one is refused at the
handshake, and the gate (dask_gpu.gate) keeps a worker's certificate, which a
GPU host must hold, from opening the doors that run code. The CA's private key
is not kept.

>>> import tempfile
>>> tls = ClusterTLS.create(tempfile.mkdtemp())
>>> tls.security("client").require_encryption
True
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _write(path: Path, data: bytes, private: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey,
          ca: bool) -> x509.Certificate:
    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=3650))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.DNSName(subject),
             x509.IPAddress(__import__("ipaddress").ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(signer, hashes.SHA256())


@dataclass(frozen=True)
class ClusterTLS:
    """Where a cluster's TLS files are: the CA certificate, and each party's certificate and key."""

    directory: Path

    @classmethod
    def create(cls, directory: str | Path) -> ClusterTLS:
        """A fresh CA and certificates for the cluster (scheduler, workers) and its one trusted client."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = _cert("aisched-cluster-ca", ca_key, _name("aisched-cluster-ca"), ca_key, ca=True)
        _write(d / "ca.pem", ca.public_bytes(serialization.Encoding.PEM), private=False)
        for party in ("scheduler", "cluster", "client"):
            key = ec.generate_private_key(ec.SECP256R1())
            cert = _cert(f"aisched-{party}", key, ca.subject, ca_key, ca=False)
            _write(d / f"{party}.pem", cert.public_bytes(serialization.Encoding.PEM), private=False)
            _write(d / f"{party}.key", key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()), private=True)
        return cls(d)

    @classmethod
    def load_or_create(cls, directory: str | Path) -> ClusterTLS:
        d = Path(directory)
        return cls(d) if (d / "ca.pem").exists() else cls.create(d)

    def security(self, party: str) -> "Security":
        """Dask's Security for `party`: "scheduler", "cluster" (the workers and their nannies) or "client" (the
        control plane). Each presents its own certificate, so the gate (dask_gpu.gate) can tell them apart."""
        from distributed.security import Security

        d = self.directory
        cert, key = str(d / f"{party}.pem"), str(d / f"{party}.key")
        role = {"scheduler": "scheduler", "cluster": "worker", "client": "client"}[party]
        return Security(tls_ca_file=str(d / "ca.pem"), require_encryption=True,
                        **{f"tls_{role}_cert": cert, f"tls_{role}_key": key})
