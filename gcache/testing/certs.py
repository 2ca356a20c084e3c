"""Throwaway TLS certificates for local clusters (``gcache up --tls``, ``gcache-bench --tls``).

``make_certs(dir)`` writes a fresh CA and two leaf certificates signed by it,
valid for a day: one for the servers and masters (named ``localhost``,
``127.0.0.1`` and ``::1``, the addresses a local cluster listens on) and one
for clients (mTLS). Both carry the server *and* client key usages, because a
server also dials its masters and a master dials its leader with its own
certificate. Keys are EC P-256; files are written mode 0600.

Not for production: real clusters take their certificates from their own CA
(cert-manager, Vault, ...). Uses the ``cryptography`` package, imported lazily.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path
from typing import NamedTuple

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


class TlsFiles(NamedTuple):
    """PEM paths of one local cluster's TLS material."""

    ca_file: str
    cert_file: str  # servers and masters
    key_file: str
    client_cert_file: str
    client_key_file: str

    def server_flags(self, require_client_cert: bool = False) -> list[str]:
        """``gcache-server`` / ``gcache-master`` flags that turn TLS on (mTLS optional)."""
        flags = ["--tls-cert-file", self.cert_file, "--tls-key-file", self.key_file,
                 "--tls-ca-file", self.ca_file]
        return flags + (["--tls-require-client-cert", "true"] if require_client_cert else [])

    def client_kwargs(self) -> dict[str, object]:
        """``Client(...)`` arguments of a client that presents its certificate."""
        return {"tls": True, "tls_ca_file": self.ca_file,
                "tls_cert_file": self.client_cert_file, "tls_key_file": self.client_key_file}


def _write(path: Path, data: bytes) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return str(path)


def make_certs(directory: str | os.PathLike[str], names: tuple[str, ...] = LOCAL_NAMES
               ) -> TlsFiles:
    """Write ``ca.pem``, ``node.pem``/``node.key`` and ``client.pem``/``client.key`` into
    ``directory`` (created if needed); ``names`` are the host names / IPs of the nodes."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gcache local"),
                          x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (x509.CertificateBuilder().subject_name(name("gcache local CA"))
               .issuer_name(name("gcache local CA")).public_key(ca_key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(start)
               .not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                            crl_sign=True, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, encipher_only=False,
                                            decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))

    def leaf(cn: str, sans: tuple[str, ...]) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        alt: list[x509.GeneralName] = []
        for s in sans:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(s)))
            except ValueError:
                alt.append(x509.DNSName(s))
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca_cert.subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(start).not_valid_after(end)
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                   ExtendedKeyUsageOID.CLIENT_AUTH]),
                            critical=False))
        if alt:
            b = b.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        cert = b.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), key_pem(key)

    node_pem, node_key = leaf("gcache node", names)
    client_pem, client_key = leaf("gcache client", ())
    return TlsFiles(_write(out / "ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM)),
                    _write(out / "node.pem", node_pem), _write(out / "node.key", node_key),
                    _write(out / "client.pem", client_pem),
                    _write(out / "client.key", client_key))
