"""Nodes that hold no token from anyone: a real node (engine, server, publisher) and node
actors on a real local Ray, launched without the cluster secret, get their tokens from the
metadata service for their pod's projected service-account token (checked by a real HTTPS
server answering TokenReviews, tests/k8s_api.py) and register; the launcher never had a way
to mint one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdcluster.core.credentials import SERVICE
from pdcluster.engine.config import EngineConfig
from pdcluster.metadata_service.client import MetadataClient
from pdcluster.metadata_service.node_tokens import PodIdentityConfig
from pdcluster.metadata_service.server import ServerThread
from pdcluster.metadata_service.tokenreview import KubernetesAPI
from pdcluster.node.config import NodeConfig
from tests.cluster_secret import TEST_SECRET
from tests.k8s_api import FakeKubernetesAPI
from tests.metadata_service.helpers import make_config, wait_until
from tests.tls_certs import make_pki

AUDIENCE = "pdcluster-metadata.test"
RAY_SA = "system:serviceaccount:llm:pd-pdcluster-ray"


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[ServerThread, FakeKubernetesAPI]]:
    api = FakeKubernetesAPI(make_pki(tmp_path / "pki"), tmp_path).start()
    identity = PodIdentityConfig(audience=AUDIENCE, namespace="llm",
                                 service_account="pd-pdcluster-ray",
                                 api=KubernetesAPI(url=api.url,
                                                   token_file=api.reviewer_token_file,
                                                   ca_file=api.pki.ca))
    config = make_config(cluster_secret=TEST_SECRET, pod_identity=identity,
                         node_allowlist={"prefill": frozenset({"p0"}),
                                         "decode": frozenset({"d0"})})
    with ServerThread(config) as server:
        yield server, api
    api.stop()


def _projected_token(api: FakeKubernetesAPI, folder: Path, pod: str) -> str:
    path = folder / f"{pod}-token"
    path.write_text(api.mint(RAY_SA, (AUDIENCE,), pod=(pod, f"uid-{pod}")))
    return str(path)


def _live_nodes(server: ServerThread) -> set[str]:
    with MetadataClient(server.address, cluster_secret=TEST_SECRET, principal=SERVICE) as c:
        return {n.node_id for n in c.list_nodes()}


def test_a_node_registers_with_the_token_its_pod_identity_bought(service, model_dirs,
                                                                 tmp_path) -> None:
    from pdcluster.node.runtime import NodeRuntime

    server, api = service
    engine = EngineConfig(model_dirs["llama-gqa"], num_kv_blocks=32, block_size=8)
    config = NodeConfig(node_id="d0", role="decode", engine=engine,
                        metadata_address=server.address, lease_ttl_s=5,
                        identity_token_file=_projected_token(api, tmp_path, "pd-ray-decode-0"))
    runtime = NodeRuntime(config).start()
    try:
        wait_until(lambda: "d0" in _live_nodes(server), what="d0 registered")
        assert len(api.reviews) == 1  # one exchange, shared by the node's clients
    finally:
        runtime.stop(drain=False, timeout_s=5)
    assert "d0" not in _live_nodes(server)  # deregistered with its proof, under that token


def test_a_node_whose_pod_identity_is_refused_never_registers(service, model_dirs,
                                                              tmp_path) -> None:
    from pdcluster.node.runtime import NodeRuntime

    server, api = service
    token = tmp_path / "default-sa-token"
    token.write_text(api.mint("system:serviceaccount:llm:default", (AUDIENCE,),
                              pod=("intruder", "uid-intruder")))
    engine = EngineConfig(model_dirs["llama-gqa"], num_kv_blocks=32, block_size=8)
    config = NodeConfig(node_id="d0", role="decode", engine=engine,
                        metadata_address=server.address, lease_ttl_s=5,
                        identity_token_file=str(token))
    runtime = NodeRuntime(config).start(registration_timeout_s=1.0)
    try:
        assert "d0" not in _live_nodes(server)
    finally:
        runtime.stop(drain=False, timeout_s=5)


@pytest.mark.slow
def test_node_actors_launched_without_the_secret_register(service, model_dirs,
                                                          tmp_path) -> None:
    """The chart's head in pod-identity mode: RayCluster without a cluster secret, its node
    actors reading the pod's projected token (one file here: one pod)."""
    from pdcluster.cluster.config import ClusterConfig
    from pdcluster.cluster.ray_cluster import RayCluster

    server, api = service
    config = ClusterConfig.from_dict({
        "model": model_dirs["llama-gqa"], "num_prefill": 1, "num_decode": 1,
        "engine": {"num_kv_blocks": 32, "block_size": 8}, "node": {"cpus": 0.5},
        "router": {"enabled": False},
        "metadata": {"address": server.address,
                     "node_identity_token_file": _projected_token(api, tmp_path, "pd-ray")}})
    cluster = RayCluster(config).start()
    try:
        assert cluster.cluster_secret is None  # nothing here could derive a token
        wait_until(lambda: _live_nodes(server) >= {"p0", "d0"}, timeout_s=60,
                   interval_s=0.5, what="both node actors registered")
    finally:
        cluster.stop(drain_timeout_s=10)
