"""Node tokens for pod identities (metadata_service/node_tokens.py), attacked over gRPC: a real
metadata service whose own `TokenReviewer` asks a real HTTPS server on 127.0.0.1 that answers
TokenReviews as kube-apiserver does (tests/k8s_api.py). Only a live, pod-bound projected token
of the release's Ray service account, for pdcluster's audience, buys a token — of an
allowlisted node id of its role, good for that node only, and only until it expires."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdcluster.core.credentials import CurveKeys
from pdcluster.metadata_service.client import MetadataClient, make_node_info
from pdcluster.metadata_service.errors import (
    MetadataAuthError,
    MetadataRequestError,
    MetadataUnavailable,
)
from pdcluster.metadata_service.node_tokens import PodIdentityConfig
from pdcluster.metadata_service.pod_token import PodTokenSource
from pdcluster.metadata_service.server import ServerThread
from pdcluster.metadata_service.tokenreview import KubernetesAPI
from pdcluster.proto import metadata_pb2 as pb
from pdcluster.proto import metadata_pb2_grpc as pb_grpc
from tests.cluster_secret import TEST_SECRET
from tests.k8s_api import FakeKubernetesAPI
from tests.metadata_service.helpers import make_config
from tests.tls_certs import issue_client_cert, make_pki

AUDIENCE = "pdcluster-metadata.test"
RAY_SA = "system:serviceaccount:llm:pd-pdcluster-ray"
POD = ("pd-ray-prefill-0", "0b6f6c1e-0000-4000-8000-000000000001")
ALLOWED = {"prefill": frozenset({"p0", "p1"}), "decode": frozenset({"d0"})}


@pytest.fixture
def api(tmp_path: Path) -> Iterator[FakeKubernetesAPI]:
    fake = FakeKubernetesAPI(make_pki(tmp_path / "pki"), tmp_path).start()
    yield fake
    fake.stop()


def _identity(fake: FakeKubernetesAPI, **overrides) -> PodIdentityConfig:
    fields = dict(audience=AUDIENCE, namespace="llm", service_account="pd-pdcluster-ray",
                  api=KubernetesAPI(url=fake.url, token_file=fake.reviewer_token_file,
                                    ca_file=fake.pki.ca))
    fields.update(overrides)
    return PodIdentityConfig(**fields)


@pytest.fixture
def server(api: FakeKubernetesAPI) -> Iterator[ServerThread]:
    config = make_config(cluster_secret=TEST_SECRET, node_allowlist=ALLOWED,
                         pod_identity=_identity(api))
    with ServerThread(config) as running:
        yield running


def _exchange(server: ServerThread, sa_token: str, node_id: str = "p0", role: str = "prefill"):
    with MetadataClient(server.address) as client:  # no bearer token: the pod has none
        return client.exchange_node_token(sa_token, node_id, role)


def _register(server: ServerThread, token: str, node_id: str = "p0", role: str = "prefill"):
    with MetadataClient(server.address, token=token) as client:
        return client.register(make_node_info(node_id, role, epoch=7,
                                              curve_public_key=CurveKeys.generate().public), 30)


def test_a_ray_pod_gets_a_token_of_its_node_bound_to_the_pod(server, api) -> None:
    sa_token = api.mint(RAY_SA, (AUDIENCE,), pod=POD, ttl_s=3600)
    before = time.time()
    reply = _exchange(server, sa_token)
    assert reply.token.startswith(f"node/p0:pod1.{POD[1]}.")  # the pod's uid is in it
    assert reply.pod_name == POD[0]
    assert before + 590 <= reply.expires_at_unix <= time.time() + 600  # token_ttl_s, not 1 h
    assert _register(server, reply.token).registration_secret  # the node registers with it
    # the product's reviewer asked Kubernetes with its own credential, for pdcluster's audience
    assert api.reviews[-1] == {"token": sa_token, "audiences": [AUDIENCE]}
    assert api.refused_callers == 0


def test_a_token_lives_no_longer_than_the_pods_own(server, api) -> None:
    reply = _exchange(server, api.mint(RAY_SA, (AUDIENCE,), pod=POD, ttl_s=2))
    assert reply.expires_at_unix <= time.time() + 2
    with MetadataClient(server.address, token=reply.token) as client:
        client.ping()
        time.sleep(max(0.0, reply.expires_at_unix - time.time()) + 0.2)
        with pytest.raises(MetadataAuthError, match="UNAUTHENTICATED"):
            client.ping()


@pytest.mark.parametrize("case", ["none", "garbage", "expired", "deleted_pod"])
def test_no_invalid_or_expired_service_account_token_buys_a_token(server, api, case) -> None:
    tokens = {"none": "", "garbage": "eyJhbGciOiJSUzI1NiJ9.e30.forged",
              "expired": api.mint(RAY_SA, (AUDIENCE,), pod=POD, ttl_s=-5),
              "deleted_pod": api.mint(RAY_SA, (AUDIENCE,), pod=("gone", "uid-gone"))}
    api.delete_pod("uid-gone")
    with pytest.raises(MetadataAuthError, match="UNAUTHENTICATED") as refused:
        _exchange(server, tokens[case])
    reason = {"none": "no service-account token", "garbage": "invalid bearer token",
              "expired": "expired", "deleted_pod": "not found"}[case]
    assert reason in refused.value.details


def test_a_token_for_another_audience_is_refused(server, api) -> None:
    # e.g. the pod's default API token (audience: the API server), or one for another service
    for audiences in (("https://kubernetes.default.svc.cluster.local",), ("vault",)):
        with pytest.raises(MetadataAuthError, match="UNAUTHENTICATED") as refused:
            _exchange(server, api.mint(RAY_SA, audiences, pod=POD))
        assert "invalid for the target audiences" in refused.value.details


@pytest.mark.parametrize("username", [
    "system:serviceaccount:llm:default",              # another pod of the namespace
    "system:serviceaccount:other:pd-pdcluster-ray",   # the same name in another namespace
    "system:serviceaccount:llm:pd-pdcluster-router",  # the release's router
    "alice@example.com",                              # a user's token
])
def test_a_token_of_another_identity_is_refused(server, api, username) -> None:
    with pytest.raises(MetadataAuthError, match="PERMISSION_DENIED") as refused:
        _exchange(server, api.mint(username, (AUDIENCE,), pod=POD))
    assert f"{username!r} may not have node tokens" in refused.value.details


def test_a_token_not_bound_to_a_pod_is_refused(server, api) -> None:
    # `kubectl create token` without --bound-object: the account's, not a pod's
    with pytest.raises(MetadataAuthError, match="not bound to a pod"):
        _exchange(server, api.mint(RAY_SA, (AUDIENCE,), pod=None))


@pytest.mark.parametrize("node_id, role", [("p9", "prefill"), ("d0", "prefill"),
                                           ("p0", "decode")])
def test_only_allowlisted_node_ids_of_the_role_are_issued(server, api, node_id, role) -> None:
    sa_token = api.mint(RAY_SA, (AUDIENCE,), pod=POD)
    with pytest.raises(MetadataAuthError, match="PERMISSION_DENIED") as refused:
        _exchange(server, sa_token, node_id, role)
    assert "is not on the" in refused.value.details and "allowlist" in refused.value.details
    assert _exchange(server, sa_token, "p1", "prefill").token.startswith("node/p1:")  # control


def test_without_an_allowlist_only_a_role_with_a_count_bound_is_issued(api) -> None:
    config = make_config(cluster_secret=TEST_SECRET, max_nodes={"prefill": 2},
                         pod_identity=_identity(api))
    with ServerThread(config) as server:
        sa_token = api.mint(RAY_SA, (AUDIENCE,), pod=POD)
        assert _exchange(server, sa_token, "planned-7", "prefill").token
        with pytest.raises(MetadataAuthError, match="bounds no decode node ids"):
            _exchange(server, sa_token, "d5", "decode")


def test_an_issued_token_is_its_nodes_only(server, api) -> None:
    token = _exchange(server, api.mint(RAY_SA, (AUDIENCE,), pod=POD)).token
    with MetadataClient(server.address, token=token) as client:
        with pytest.raises(MetadataAuthError, match="may not release"):
            client.release_node("p1")  # operator's
        with pytest.raises(MetadataAuthError, match="may not register a router's key"):
            client.register_client("evil", CurveKeys.generate().public, 30)  # service's
        with pytest.raises(MetadataAuthError, match="may not act as node 'p1'"):
            client.register(make_node_info("p1", "prefill", epoch=1,
                                           curve_public_key=CurveKeys.generate().public), 30)
    # tampered: another node id, pod or expiry under the same MAC proves nothing
    _, _, rest = token.partition(":")
    _, uid, expiry, mac = rest.split(".")
    for forged in (f"node/p1:{rest}", f"node/p0:pod1.other-uid.{expiry}.{mac}",
                   f"node/p0:pod1.{uid}.{int(expiry) + 86400}.{mac}"):
        with MetadataClient(server.address, token=forged) as client, \
                pytest.raises(MetadataAuthError, match="UNAUTHENTICATED"):
            client.ping()


def test_no_other_call_is_let_through_without_a_bearer_token(server, api) -> None:
    with MetadataClient(server.address) as client:
        with pytest.raises(MetadataAuthError, match="UNAUTHENTICATED"):
            client.list_nodes()
        with pytest.raises(MetadataAuthError, match="UNAUTHENTICATED"):
            client.register(make_node_info("p0", "prefill", epoch=1), 30)


def test_a_service_without_pod_identity_issues_and_accepts_no_pod_tokens(api, server) -> None:
    issued = _exchange(server, api.mint(RAY_SA, (AUDIENCE,), pod=POD)).token
    with ServerThread(make_config(cluster_secret=TEST_SECRET)) as plain:
        with pytest.raises(MetadataRequestError, match="issues no node tokens"):
            _exchange(plain, api.mint(RAY_SA, (AUDIENCE,), pod=POD))
        with MetadataClient(plain.address, token=issued) as client, \
                pytest.raises(MetadataAuthError, match="UNAUTHENTICATED"):
            client.ping()


def test_kubernetes_refusing_the_reviewer_is_unavailable_not_a_pass(api, tmp_path) -> None:
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-reviewers-token")
    identity = _identity(api, api=KubernetesAPI(url=api.url, token_file=str(wrong),
                                                ca_file=api.pki.ca))
    with ServerThread(make_config(cluster_secret=TEST_SECRET, node_allowlist=ALLOWED,
                                  pod_identity=identity)) as server, \
            pytest.raises(MetadataUnavailable, match="HTTP 401"):
        _exchange(server, api.mint(RAY_SA, (AUDIENCE,), pod=POD))
    api.forbid_reviewer()  # no system:auth-delegator
    with ServerThread(make_config(cluster_secret=TEST_SECRET, node_allowlist=ALLOWED,
                                  pod_identity=_identity(api))) as server, \
            pytest.raises(MetadataUnavailable, match="HTTP 403"):
        _exchange(server, api.mint(RAY_SA, (AUDIENCE,), pod=POD))


def test_an_api_server_with_a_certificate_from_another_ca_is_not_asked(api) -> None:
    identity = _identity(api, api=KubernetesAPI(url=api.url, token_file=api.reviewer_token_file,
                                                ca_file=api.pki.rogue_ca))
    with ServerThread(make_config(cluster_secret=TEST_SECRET, node_allowlist=ALLOWED,
                                  pod_identity=identity)) as server, \
            pytest.raises(MetadataUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
        _exchange(server, api.mint(RAY_SA, (AUDIENCE,), pod=POD))
    assert api.reviews == []  # the pod's token never went to it


def test_a_node_renews_its_token_from_its_rotated_projected_token(server, api,
                                                                  tmp_path) -> None:
    token_file = tmp_path / "projected-token"
    token_file.write_text(api.mint(RAY_SA, (AUDIENCE,), pod=POD, ttl_s=3))
    now = [time.time()]
    source = PodTokenSource(server.address, "p0", "prefill", str(token_file),
                            clock=lambda: now[0])
    first = source()
    assert source() == first and source.num_exchanges == 1  # cached while fresh
    token_file.write_text(api.mint(RAY_SA, (AUDIENCE,), pod=POD, ttl_s=600))  # the kubelet
    now[0] += 2.5  # past two thirds of its life
    second = source()
    assert second != first and source.num_exchanges == 2
    _register(server, second)
    api.delete_pod(POD[1])  # the pod is gone: its token no longer renews...
    now[0] += 500
    assert source() == second  # ...the current one serves until it expires
    now[0] += 200
    with pytest.raises(MetadataAuthError, match="not found"):
        source()


def test_a_flood_of_exchanges_is_refused_past_the_review_slots(api) -> None:
    identity = _identity(api, max_concurrent_reviews=1)
    with ServerThread(make_config(cluster_secret=TEST_SECRET, node_allowlist=ALLOWED,
                                  pod_identity=identity)) as server:
        channel = grpc.insecure_channel(server.address)
        stub = pb_grpc.MetadataServiceStub(channel)
        request = pb.NodeTokenRequest(node_id="p0", role=pb.PREFILL,
                                      service_account_token=api.mint(RAY_SA, (AUDIENCE,),
                                                                     pod=POD))
        futures = [stub.ExchangeNodeToken.future(request, timeout=10) for _ in range(20)]
        codes = [f.exception().code() if f.exception() else grpc.StatusCode.OK
                 for f in futures]
        channel.close()
    assert grpc.StatusCode.OK in codes and grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}


def test_under_bound_mtls_only_a_node_certificate_may_exchange(api, tmp_path) -> None:
    """The chart's default transport: the exchange needs no bearer token, but the connection's
    certificate must still be a node's (a router's or operator's pod cannot buy node tokens
    even with a Ray pod's stolen service-account token)."""
    pki = make_pki(tmp_path / "mtls")
    config = make_config(cluster_secret=TEST_SECRET, node_allowlist=ALLOWED,
                         pod_identity=_identity(api), tls_cert_file=pki.server_cert,
                         tls_key_file=pki.server_key, tls_client_ca_file=pki.client_ca,
                         tls_bind_client_roles=True)
    sa_token = api.mint(RAY_SA, (AUDIENCE,), pod=POD)
    with ServerThread(config) as server:
        for kind, common_name in (("router", "pdcluster-router"),
                                  ("operator", "pdcluster-operator"),
                                  ("node", "pdcluster-node.pd-ray-prefill-0")):
            cert, key = issue_client_cert(pki, tmp_path, kind, common_name)
            with MetadataClient(server.address, tls_ca_file=pki.ca, tls_cert_file=cert,
                                tls_key_file=key) as client:
                if kind != "node":
                    with pytest.raises(MetadataAuthError, match="bound to its own kind"):
                        client.exchange_node_token(sa_token, "p0", "prefill")
                    continue
                token = client.exchange_node_token(sa_token, "p0", "prefill").token
            with MetadataClient(server.address, token=token, tls_ca_file=pki.ca,
                                tls_cert_file=cert, tls_key_file=key) as node:
                node.register(make_node_info("p0", "prefill", epoch=1,
                                             curve_public_key=CurveKeys.generate().public), 30)
    assert len(api.reviews) == 1  # the refused certificates never reached Kubernetes


def test_the_cli_serves_pod_identity_with_the_kubernetes_settings_it_is_given(api,
                                                                               tmp_path) -> None:
    """`pdcluster metadata serve` as the chart runs it (its flags; the API server, token and
    CA files named as a pod would find them), in its own process."""
    import subprocess
    import sys

    from pdcluster.benchmarks.ports import free_port
    from pdcluster.core.credentials import SECRET_FILE_ENV, write_secret_file

    port = free_port()
    env = {**os.environ, SECRET_FILE_ENV: str(write_secret_file(TEST_SECRET,
                                                                tmp_path / "secret"))}
    env.pop("PDCLUSTER_CLUSTER_SECRET", None)
    args = [sys.executable, "-m", "pdcluster.cluster.cli", "metadata", "serve", "--port",
            str(port), "--allow-nodes=prefill=p0", "--allow-nodes=decode=d0",
            f"--pod-identity-audience={AUDIENCE}",
            "--pod-identity-service-account=llm:pd-pdcluster-ray",
            f"--kubernetes-api={api.url}", f"--kubernetes-token-file={api.reviewer_token_file}",
            f"--kubernetes-ca-file={api.pki.ca}"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert "listening on 127.0.0.1:" in proc.stdout.readline()
        with MetadataClient(f"127.0.0.1:{port}") as client:
            reply = client.exchange_node_token(api.mint(RAY_SA, (AUDIENCE,), pod=POD), "p0",
                                               "prefill")
            with pytest.raises(MetadataAuthError, match="may not have node tokens"):
                client.exchange_node_token(api.mint("system:serviceaccount:llm:default",
                                                    (AUDIENCE,), pod=POD), "p0", "prefill")
        with MetadataClient(f"127.0.0.1:{port}", token=reply.token) as node:
            node.register(make_node_info("p0", "prefill", epoch=1,
                                         curve_public_key=CurveKeys.generate().public), 30)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    missing = subprocess.run([*args[:7], f"--pod-identity-audience={AUDIENCE}"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2
    assert "needs --pod-identity-service-account NAMESPACE:NAME" in missing.stderr


def test_the_api_server_is_found_as_a_pod_sees_it_and_never_over_plain_http() -> None:
    from pdcluster.metadata_service.tokenreview import in_cluster_url

    assert in_cluster_url({"KUBERNETES_SERVICE_HOST": "10.96.0.1",
                           "KUBERNETES_SERVICE_PORT": "443"}) == "https://10.96.0.1:443"
    assert in_cluster_url({"KUBERNETES_SERVICE_HOST": "fd00::1"}) == "https://[fd00::1]:443"
    with pytest.raises(ValueError, match="not in a Kubernetes pod"):
        in_cluster_url({})
    with pytest.raises(ValueError, match="only on 127.0.0.1"):
        KubernetesAPI(url="http://10.96.0.1:80", token_file="/t")
