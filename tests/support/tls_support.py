"""Throwaway certificates for the TLS tests (made with ``cryptography`` in the test, never shipped)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path


def certificates(d: Path) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1/localhost, a client certificate, and a
    ``roles`` certificate (server and client) for the name ``onpolicy-roles`` only."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    paths: dict[str, Path] = {}

    def write(name: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        paths[f"{name}_key"] = d / f"{name}.key"
        paths[f"{name}_key"].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
        paths[f"{name}_cert"] = d / f"{name}.pem"
        paths[f"{name}_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def issue(name: str, issuer: x509.Name | None, issuer_key: ec.EllipticCurvePrivateKey | None,
              extensions: list[tuple[x509.ExtensionType, bool]]) -> tuple[ec.EllipticCurvePrivateKey, x509.Name]:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer or subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1)))
        for ext, critical in extensions:
            builder = builder.add_extension(ext, critical)
        write(name, key, builder.sign(issuer_key or key, hashes.SHA256()))
        return key, subject

    ca_key, ca_name = issue("ca", None, None, [(x509.BasicConstraints(ca=True, path_length=None), True)])
    leaf = [(x509.BasicConstraints(ca=False, path_length=None), True)]
    issue("server", ca_name, ca_key, [*leaf, (x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False),
        (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)])
    issue("client", ca_name, ca_key, [*leaf, (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)])
    issue("roles", ca_name, ca_key, [*leaf, (x509.SubjectAlternativeName([x509.DNSName("onpolicy-roles")]), False),
                                     (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                             ExtendedKeyUsageOID.CLIENT_AUTH]), False)])
    return paths
