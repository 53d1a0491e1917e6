"""A throwaway certificate authority for the TLS rows: a CA, a server certificate
for 127.0.0.1 and localhost, and a bearer token, written to a directory."""

from __future__ import annotations

import datetime
import ipaddress
import secrets
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Pki", "make_pki"]


@dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path
    key: Path
    token: str
    token_file: Path


def make_pki(directory: Path) -> Pki:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def certificate(subject: str, key, issuer: x509.Name, signer, extensions):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "collectives bench CA")])
    ca = certificate(
        "collectives bench CA", ca_key, ca_name, ca_key,
        [(x509.BasicConstraints(ca=True, path_length=None), True)],
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    server = certificate(
        "localhost", key, ca_name, ca_key,
        [
            (x509.BasicConstraints(ca=False, path_length=None), True),
            (x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ), False),
            (x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ), False),
        ],
    )  # fmt: skip
    pem = serialization.Encoding.PEM
    (directory / "ca.pem").write_bytes(ca.public_bytes(pem))
    (directory / "server.pem").write_bytes(server.public_bytes(pem))
    key_path = directory / "server.key"
    key_path.write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_path.chmod(0o600)
    token = secrets.token_urlsafe(24)
    token_file = directory / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    return Pki(directory / "ca.pem", directory / "server.pem", key_path, token, token_file)
