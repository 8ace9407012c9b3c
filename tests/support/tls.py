"""TCP listener helpers for tests: a self-signed certificate, and the port a daemon bound."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

from ucm_server.testing.daemon import DaemonProcess


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed server certificate for ``localhost`` and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def tcp_port(d: DaemonProcess) -> int:
    """The TCP port the daemon logged it listens on (``--listen 127.0.0.1:0`` picks a free one)."""
    match = re.search(r"listening on tcp [^:]+:(\d+)", d.log())
    assert match, d.log()
    return int(match.group(1))
