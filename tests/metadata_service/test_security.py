"""Credentials on every call, node identity, TLS and mTLS: missing or wrong credentials are refused
(UNAUTHENTICATED), a node's credential acts only for that node (PERMISSION_DENIED), the
service credential reads but never acts as a node. tests/security/ attacks the real processes.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pdcluster.core.credentials import SERVICE, ClusterSecret, node_principal
from pdcluster.core.tls import ClientTLS, TLSFileError
from pdcluster.metadata_service.client import MetadataClient, make_node_info
from pdcluster.metadata_service.errors import MetadataAuthError, MetadataUnavailable
from pdcluster.metadata_service.server import ServerThread
from tests.cluster_secret import SERVICE_TOKEN, TEST_SECRET, node_token
from tests.metadata_service.helpers import make_chain, make_config
from tests.tls_certs import make_pki

OTHER_SECRET = ClusterSecret(bytes(range(1, 33)))


@pytest.fixture(scope="module")
def secure_server():
    with ServerThread(make_config(cluster_secret=TEST_SECRET)) as server:
        yield server


@pytest.mark.parametrize("token", [None, "wrong", SERVICE_TOKEN + "x", "Bearer",
                                   OTHER_SECRET.metadata_token(SERVICE),
                                   OTHER_SECRET.metadata_token(node_principal("p0"))])
@pytest.mark.parametrize("call", ["ping", "stats", "query", "register", "list_nodes"])
def test_missing_or_wrong_token_is_refused(secure_server, token, call) -> None:
    args = {"query": (make_chain("t", 2),), "register": (make_node_info("p0", "prefill"),)}
    with MetadataClient(secure_server.address, token=token) as c, \
            pytest.raises(MetadataAuthError, match="UNAUTHENTICATED|missing or invalid token"):
        getattr(c, call)(*args.get(call, ()))
    assert secure_server.call(lambda s: s.list_nodes()) == [], "a refused call did no work"


def test_streaming_call_is_refused_without_token(secure_server) -> None:
    with MetadataClient(secure_server.address) as c, pytest.raises(MetadataAuthError):
        next(iter(c.watch_nodes()))


def test_a_node_acts_as_itself_only(secure_server) -> None:
    with MetadataClient(secure_server.address, token=node_token("p0")) as p0, \
            MetadataClient(secure_server.address, cluster_secret=TEST_SECRET,
                           principal=node_principal("d0")) as d0:
        info = make_node_info("d0", "decode", request_address="tcp://10.0.0.1:1")
        d0.register(info, 5)
        for call, args in [("register", (make_node_info("d0", "decode"), 5)),
                           ("heartbeat", ("d0", info.epoch)),
                           ("publish", ("d0", info.epoch, 1, [])),
                           ("snapshot", ("d0", info.epoch, 1, [])),
                           ("deregister", ("d0",))]:
            with pytest.raises(MetadataAuthError, match="PERMISSION_DENIED.*'node/p0' may not "
                               "act as node 'd0'"):
                getattr(p0, call)(*args)
        assert [n.request_address for n in p0.list_nodes()] == ["tcp://10.0.0.1:1"]
        p0.register(make_node_info("p0", "prefill"), 5)
        d0.deregister("d0")
        p0.deregister("p0")
        assert p0.list_nodes() == []


def test_the_service_credential_reads_but_never_acts_as_a_node(secure_server) -> None:
    with MetadataClient(secure_server.address, cluster_secret=TEST_SECRET) as service:
        assert service.list_nodes() == [] and service.query(make_chain("t", 2)) == []
        service.ping()
        with pytest.raises(MetadataAuthError, match="PERMISSION_DENIED.*'service' may not"):
            service.register(make_node_info("d0", "decode"), 5)
        with pytest.raises(MetadataAuthError, match="PERMISSION_DENIED"):
            service.deregister("d0")


def test_client_takes_a_token_or_a_secret_not_both() -> None:
    with pytest.raises(ValueError, match="not both"):
        MetadataClient("127.0.0.1:1", token=SERVICE_TOKEN, cluster_secret=TEST_SECRET)


def test_config_needs_a_secret_unless_explicitly_unauthenticated() -> None:
    with pytest.raises(ValueError, match="needs cluster_secret"):
        make_config(allow_unauthenticated=False)
    with pytest.raises(ValueError, match="not both"):
        make_config(cluster_secret=TEST_SECRET, allow_unauthenticated=True)


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
    config = make_config(cluster_secret=TEST_SECRET, tls_cert_file=cert, tls_key_file=key)
    with ServerThread(config) as server:
        with MetadataClient(server.address, token=node_token("p0"), tls_ca_file=cert) as c:
            c.ping()
            c.register(make_node_info("p0", "prefill"), 5)
            with pytest.raises(MetadataAuthError, match="PERMISSION_DENIED"):
                c.deregister("d0")
            c.deregister("p0")
        with MetadataClient(server.address, token="bad", tls_ca_file=cert) as c, \
                pytest.raises(MetadataAuthError):
            c.ping()
        # Plaintext to a TLS port, and TLS with a CA that did not sign the server's cert.
        with MetadataClient(server.address, token=SERVICE_TOKEN, timeout_s=1) as c, \
                pytest.raises(MetadataUnavailable):
            c.ping()
        with MetadataClient(server.address, token=SERVICE_TOKEN, tls_ca_file=other_cert,
                            timeout_s=1) as c, pytest.raises(MetadataUnavailable):
            c.ping()


def test_config_rejects_half_tls() -> None:
    with pytest.raises(ValueError, match="both tls_cert_file and tls_key_file"):
        make_config(tls_cert_file="x.pem")


def test_mtls_requires_a_certificate_from_the_client_ca(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    config = make_config(cluster_secret=TEST_SECRET, tls_cert_file=pki.server_cert,
                         tls_key_file=pki.server_key, tls_client_ca_file=pki.client_ca)
    with ServerThread(config) as server:
        for keys in ({}, {"tls_cert_file": pki.rogue_cert, "tls_key_file": pki.rogue_key}):
            with MetadataClient(server.address, token=SERVICE_TOKEN, tls_ca_file=pki.ca,
                                timeout_s=2, **keys) as c, pytest.raises(MetadataUnavailable):
                c.ping()
        with MetadataClient(server.address, token=node_token("p0"), tls_ca_file=pki.ca,
                            tls_cert_file=pki.client_cert, tls_key_file=pki.client_key) as c:
            c.register(make_node_info("p0", "prefill"), 5)
            assert [n.node_id for n in c.list_nodes()] == ["p0"]
        with MetadataClient(server.address, tls_ca_file=pki.ca, tls_cert_file=pki.client_cert,
                            tls_key_file=pki.client_key) as c, \
                pytest.raises(MetadataAuthError, match="UNAUTHENTICATED"):
            c.ping()  # the certificate opens the connection, not the calls


def test_config_rejects_a_client_ca_without_tls() -> None:
    with pytest.raises(ValueError, match="tls_client_ca_file .mTLS. needs TLS"):
        make_config(cluster_secret=TEST_SECRET, tls_client_ca_file="ca.pem")


def test_client_tls_settings_are_validated(tmp_path: Path) -> None:
    assert ClientTLS.from_fields(None) is None
    with pytest.raises(ValueError, match="need metadata_tls_ca"):
        ClientTLS.from_fields(None, server_name="localhost")
    with pytest.raises(ValueError, match="both its cert and key"):
        ClientTLS.from_fields("ca.pem", cert="c.pem")
    with pytest.raises(TLSFileError, match="cannot read TLS file .*missing.pem"):
        MetadataClient("127.0.0.1:1", token=SERVICE_TOKEN,
                       tls_ca_file=str(tmp_path / "missing.pem"))
