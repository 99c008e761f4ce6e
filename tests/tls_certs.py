"""Throwaway PKIs for TLS tests, made with `cryptography` (EC P-256, valid for an hour).

    pki = make_pki(tmp_path)
    pki.ca            # PEM file: the CA that signed the server's certificate
    pki.server_cert, pki.server_key    # for 127.0.0.1 and localhost
    pki.client_ca     # PEM file: the CA mTLS clients must be signed by
    pki.client_cert, pki.client_key    # signed by client_ca
    pki.rogue_cert, pki.rogue_key      # a client certificate from a CA the server does not trust
    pki.rogue_ca      # that CA (also: a CA that did not sign the server's certificate)
    issue_client_cert(pki, tmp_path, "node-p0", "pdcluster-node.p0")  # another client_ca cert
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_Key = ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class Pki:
    ca: str
    server_cert: str
    server_key: str
    client_ca: str
    client_cert: str
    client_key: str
    rogue_ca: str
    rogue_cert: str
    rogue_key: str


def make_pki(folder: Path) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    ca = _certificate(folder, "ca", "test server CA", ca=True)
    client_ca = _certificate(folder, "client-ca", "test client CA", ca=True)
    rogue_ca = _certificate(folder, "rogue-ca", "rogue CA", ca=True)
    server = _certificate(folder, "server", "localhost", issuer=ca, server=True)
    client = _certificate(folder, "client", "router", issuer=client_ca)
    rogue = _certificate(folder, "rogue", "attacker", issuer=rogue_ca)
    return Pki(ca=ca[0], server_cert=server[0], server_key=server[1], client_ca=client_ca[0],
               client_cert=client[0], client_key=client[1], rogue_ca=rogue_ca[0],
               rogue_cert=rogue[0], rogue_key=rogue[1])


_Issued = tuple[str, str, x509.Certificate, _Key]


def issue_client_cert(pki: Pki, folder: Path, stem: str, common_name: str) -> tuple[str, str]:
    """(cert file, key file) of a client certificate named ``common_name``, signed by
    ``pki.client_ca``."""
    ca_cert = x509.load_pem_x509_certificate(Path(pki.client_ca).read_bytes())
    ca_key = serialization.load_pem_private_key(
        Path(pki.client_ca).with_suffix(".key").read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey), "make_pki makes EC keys"
    issued = _certificate(folder, stem, common_name,
                          issuer=(pki.client_ca, "", ca_cert, ca_key))
    return issued[0], issued[1]


def _certificate(folder: Path, stem: str, common_name: str, *, issuer: _Issued | None = None,
                 ca: bool = False, server: bool = False) -> _Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    issuer_name, signing_key = (name, key) if issuer is None else (issuer[2].subject, issuer[3])
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=1))
               .not_valid_after(now + datetime.timedelta(hours=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    if not ca:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    cert = builder.sign(signing_key, hashes.SHA256())
    cert_file, key_file = folder / f"{stem}.crt", folder / f"{stem}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file), cert, key
