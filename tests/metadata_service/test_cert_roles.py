"""Per-workload metadata client certificates, bound to their tokens (cert_roles.py): under mTLS
with `tls_bind_client_roles`, a router's token over a node's certificate and a node's token over
the router's certificate are refused, streams included; each over its own kind's certificate is
served (the member control); a certificate naming no role is refused."""

from __future__ import annotations

from itertools import islice
from pathlib import Path

import pytest

from pdcluster.core.credentials import OPERATOR, SERVICE
from pdcluster.metadata_service.cert_roles import certificate_role, may_present
from pdcluster.metadata_service.client import MetadataClient, make_node_info
from pdcluster.metadata_service.errors import MetadataAuthError
from pdcluster.metadata_service.server import ServerThread
from tests.cluster_secret import SERVICE_TOKEN, TEST_SECRET, node_token
from tests.metadata_service.helpers import make_config
from tests.tls_certs import issue_client_cert, make_pki

OPERATOR_TOKEN = TEST_SECRET.metadata_token(OPERATOR)


@pytest.fixture
def bound(tmp_path: Path):
    """(server address, {kind: (cert, key)}, ca) of a server that binds roles."""
    pki = make_pki(tmp_path)
    certs = {
        "router": issue_client_cert(pki, tmp_path, "router", "pdcluster-router"),
        "node": issue_client_cert(pki, tmp_path, "node", "pdcluster-node.pd-ray-prefill-x7"),
        "operator": issue_client_cert(pki, tmp_path, "operator", "pdcluster-operator"),
        "no-role": (pki.client_cert, pki.client_key),  # CN "router": the shared cert of old
    }
    config = make_config(cluster_secret=TEST_SECRET, tls_cert_file=pki.server_cert,
                         tls_key_file=pki.server_key, tls_client_ca_file=pki.client_ca,
                         tls_bind_client_roles=True)
    with ServerThread(config) as server:
        yield server.address, certs, pki.ca


def connect(bound, kind: str, token: str) -> MetadataClient:
    address, certs, ca = bound
    cert, key = certs[kind]
    return MetadataClient(address, token=token, tls_ca_file=ca, tls_cert_file=cert,
                          tls_key_file=key, timeout_s=5)


def test_a_router_token_over_a_node_certificate_is_refused(bound) -> None:
    with connect(bound, "node", SERVICE_TOKEN) as c:
        with pytest.raises(MetadataAuthError, match="PERMISSION_DENIED"):
            c.list_nodes()
        with pytest.raises(MetadataAuthError, match="bound to its own kind of pod"):
            c.register_client("evil-router", b"k" * 40, 30)
        with pytest.raises(MetadataAuthError, match="PERMISSION_DENIED"):
            next(iter(c.watch_nodes()))  # a stream is checked before its first message
    with connect(bound, "router", SERVICE_TOKEN) as c:  # control: the router's own cert
        assert c.list_nodes() == []
        c.register_client("router-0", b"k" * 40, 30)
        assert [k.client_id for k in c.list_clients()] == ["router-0"]


def test_a_node_token_over_the_router_certificate_is_refused(bound) -> None:
    with connect(bound, "router", node_token("p0")) as c, \
            pytest.raises(MetadataAuthError, match="PERMISSION_DENIED"):
        c.register(make_node_info("p0", "prefill"), 5)
    with connect(bound, "node", node_token("p0")) as c:  # control: a node's cert
        c.register(make_node_info("p0", "prefill"), 5)
        assert [n.node_id for n in c.list_nodes()] == ["p0"]
        changes = list(islice(c.watch_nodes(), 1))
        assert changes[0].node.node_id == "p0"


def test_the_operator_certificate_carries_the_operator_and_nothing_of_a_node(bound) -> None:
    with connect(bound, "operator", OPERATOR_TOKEN) as c:
        c.ping()
    with connect(bound, "operator", node_token("p0")) as c, \
            pytest.raises(MetadataAuthError, match="PERMISSION_DENIED"):
        c.register(make_node_info("p0", "prefill"), 5)
    with connect(bound, "node", OPERATOR_TOKEN) as c, \
            pytest.raises(MetadataAuthError, match="PERMISSION_DENIED"):
        c.release_node("p0")


def test_a_certificate_without_a_role_is_refused_when_bound(bound) -> None:
    for token in (SERVICE_TOKEN, node_token("p0")):
        with connect(bound, "no-role", token) as c, \
                pytest.raises(MetadataAuthError, match="names no pdcluster role"):
            c.ping()


def test_roles_from_common_names() -> None:
    assert certificate_role("pdcluster-router") == "router"
    assert certificate_role("pdcluster-node.pd-ray-decode-0") == "node"
    assert certificate_role("pdcluster-nodes") is None
    assert certificate_role("router") is None and certificate_role(None) is None
    assert may_present("node", "node/d0") and not may_present("node", "node/")
    assert not may_present("node", SERVICE) and not may_present("router", "node/d0")
    assert may_present("operator", SERVICE) and not may_present(None, SERVICE)


def test_binding_needs_mtls() -> None:
    with pytest.raises(ValueError, match="needs mTLS"):
        make_config(cluster_secret=TEST_SECRET, tls_bind_client_roles=True)
