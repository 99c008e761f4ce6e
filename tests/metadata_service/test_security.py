"""Shared token on every call, and TLS: missing or wrong credentials are refused."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from metadata_service.client import MetadataClient, make_node_info
from metadata_service.errors import MetadataAuthError, MetadataUnavailable
from metadata_service.server import ServerThread
from tests.metadata_service.helpers import make_chain, make_config

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def token_server():
    with ServerThread(make_config(token=TOKEN)) as server:
        yield server


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x"])
@pytest.mark.parametrize("call", ["ping", "stats", "query", "register", "list_nodes"])
def test_missing_or_wrong_token_is_refused(token_server, token, call) -> None:
    args = {"query": (make_chain("t", 2),), "register": (make_node_info("p0", "prefill"),)}
    with MetadataClient(token_server.address, token=token) as c, \
            pytest.raises(MetadataAuthError, match="UNAUTHENTICATED|missing or wrong token"):
        getattr(c, call)(*args.get(call, ()))
    assert token_server.call(lambda s: s.list_nodes()) == [], "a refused call did no work"


def test_streaming_call_is_refused_without_token(token_server) -> None:
    with MetadataClient(token_server.address) as c, pytest.raises(MetadataAuthError):
        next(iter(c.watch_nodes()))


def test_right_token_is_accepted(token_server) -> None:
    with MetadataClient(token_server.address, token=TOKEN) as c:
        c.register(make_node_info("ok", "decode"), 5)
        assert [n.node_id for n in c.list_nodes()] == ["ok"]
        c.deregister("ok")


def _write_self_signed(folder: Path) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


def test_tls_with_token(tmp_path: Path) -> None:
    cert, key = _write_self_signed(tmp_path)
    (tmp_path / "other").mkdir()
    other_cert, _ = _write_self_signed(tmp_path / "other")
    config = make_config(token=TOKEN, tls_cert_file=cert, tls_key_file=key)
    with ServerThread(config) as server:
        with MetadataClient(server.address, token=TOKEN, tls_ca_file=cert) as c:
            c.ping()
        with MetadataClient(server.address, token="bad", tls_ca_file=cert) as c, \
                pytest.raises(MetadataAuthError):
            c.ping()
        # Plaintext to a TLS port, and TLS with a CA that did not sign the server's cert.
        with MetadataClient(server.address, token=TOKEN, timeout_s=1) as c, \
                pytest.raises(MetadataUnavailable):
            c.ping()
        with MetadataClient(server.address, token=TOKEN, tls_ca_file=other_cert,
                            timeout_s=1) as c, pytest.raises(MetadataUnavailable):
            c.ping()


def test_config_rejects_half_tls() -> None:
    with pytest.raises(ValueError, match="both tls_cert_file and tls_key_file"):
        make_config(tls_cert_file="x.pem")
