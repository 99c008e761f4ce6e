"""TLS and mTLS to the metadata service, end to end, against real `pdcluster metadata serve`
processes: one serving TLS, one requiring client certificates (mTLS). A throwaway PKI is made
per module (tests/tls_certs.py).

- The router's link (`MetadataLink` with the CA) lists nodes and mirrors the block index
  (WatchBlocks) over TLS; a node (the `NodeConfig` -> `MetadataClient` path NodeRuntime uses,
  a real `NodeRuntime`, and the node actors `RayCluster` launches from a `ClusterConfig`, as
  `pdcluster serve` and cluster.yaml build it) registers and publishes over TLS and mTLS.
- Plaintext, or TLS with a CA that did not sign the service's certificate, fails cleanly: the
  link reports the service unavailable and routes on load alone, within its timeout; the
  client library raises `MetadataUnavailable`. Nothing hangs.
- Under mTLS a client with no certificate, or one from a CA the service does not trust, is
  refused at the handshake, even with a valid token; one signed by the client CA works, and
  still needs its token: the certificate authenticates the connection, the token the
  principal (a certified router cannot act as a node).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from pdcluster.benchmarks.ports import free_port
from pdcluster.core.credentials import SECRET_ENV, SECRET_FILE_ENV, SERVICE, write_secret_file
from pdcluster.core.tls import ClientTLS
from pdcluster.engine.config import EngineConfig
from pdcluster.metadata_service.client import MetadataClient, make_node_info
from pdcluster.metadata_service.errors import MetadataAuthError, MetadataUnavailable
from pdcluster.metadata_service.publisher import NodePublisher
from pdcluster.node.config import NodeConfig
from pdcluster.node.runtime import metadata_client
from pdcluster.proto import metadata_pb2 as pb
from pdcluster.proto import metadata_pb2_grpc as pb_grpc
from pdcluster.router.routing.metadata_link import MetadataLink
from tests.cluster_secret import SERVICE_TOKEN, TEST_SECRET, node_token
from tests.metadata_service.helpers import FakeNode, make_chain, wait_until
from tests.tls_certs import Pki, make_pki

ROOT = Path(__file__).resolve().parents[2]
CHAIN = make_chain("tls", 6)


@dataclass
class Service:
    address: str
    pki: Pki


def _serve(tmp: Path, pki: Pki, *tls_args: str) -> Iterator[Service]:
    port = free_port()
    secret_file = write_secret_file(TEST_SECRET, tmp / "cluster-secret")
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdcluster.cluster.cli", "metadata", "serve", "--port", str(port),
         "--lease-ttl", "30", "--tls-cert", pki.server_cert, "--tls-key", pki.server_key,
         *tls_args],
        cwd=ROOT, env={**env, SECRET_FILE_ENV: str(secret_file)}, stdout=subprocess.PIPE,
        text=True)
    try:
        assert "listening on 127.0.0.1:" in proc.stdout.readline()
        yield Service(f"127.0.0.1:{port}", pki)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_service(tmp_path_factory, pki) -> Iterator[Service]:
    yield from _serve(tmp_path_factory.mktemp("tls"), pki)


@pytest.fixture(scope="module")
def mtls_service(tmp_path_factory, pki) -> Iterator[Service]:
    yield from _serve(tmp_path_factory.mktemp("mtls"), pki, "--tls-client-ca", pki.client_ca)


def node_config(service: Service, node_id: str, *, client_cert: bool) -> NodeConfig:
    pki = service.pki
    cert = {"metadata_tls_cert": pki.client_cert, "metadata_tls_key": pki.client_key}
    return NodeConfig(node_id=node_id, role="prefill", engine=EngineConfig("unused"),
                      metadata_address=service.address, bootstrap_token=node_token(node_id),
                      metadata_tls_ca=pki.ca, **(cert if client_cert else {}))


def register_node(config: NodeConfig) -> tuple[NodePublisher, MetadataClient]:
    """A node's registration and first publish, through the client NodeRuntime builds."""
    client = metadata_client(config)
    node = FakeNode()
    publisher = NodePublisher(client, make_node_info(config.node_id, config.role,
                                                     request_address="tcp://127.0.0.1:1"),
                              lambda: node.cached, 30)
    publisher.register()
    publisher.publish([node.store(CHAIN)])
    return publisher, client


async def _until(predicate, timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _link_works(address: str, tls: ClientTLS, node_id: str) -> None:
    link = MetadataLink(address, token=SERVICE_TOKEN, tls=tls)
    try:
        nodes = await link.list_nodes()
        assert nodes is not None and node_id in {n.node_id for n in nodes}, link.last_error
        await _until(lambda: link.mirror_in_sync, what="the mirror over TLS")
        assert (await link.prefix_hits(CHAIN)).get(node_id) == len(CHAIN)
        assert link.available and link.watch_error == ""
    finally:
        await link.close()


async def _link_fails_cleanly(address: str, tls: ClientTLS | None) -> None:
    """A link whose channel cannot complete a handshake: unavailable, no hang, no mirror."""
    link = MetadataLink(address, token=SERVICE_TOKEN, tls=tls, timeout_s=0.5)
    try:
        started = time.monotonic()
        assert await asyncio.wait_for(link.list_nodes(), 5) is None
        assert await asyncio.wait_for(link.prefix_hits(CHAIN), 5) is None
        assert time.monotonic() - started < 3, "a refused handshake must not hang"
        assert not link.available and link.last_error.startswith(("UNAVAILABLE",
                                                                    "DEADLINE_EXCEEDED"))
        await _until(lambda: link.watch_error != "", what="the watch to report its failure")
        assert not link.mirror_in_sync and link.mirror_blocks == 0
    finally:
        await asyncio.wait_for(link.close(), 5)


# -- TLS -------------------------------------------------------------------------------------


def test_router_link_and_node_over_tls(tls_service) -> None:
    publisher, client = register_node(node_config(tls_service, "p-tls", client_cert=False))
    try:
        asyncio.run(_link_works(tls_service.address, ClientTLS(tls_service.pki.ca), "p-tls"))
        # the name override: the certificate names localhost, the address is an IP
        asyncio.run(_link_works(tls_service.address,
                                ClientTLS(tls_service.pki.ca, server_name="localhost"), "p-tls"))
    finally:
        publisher.deregister()
        client.close()


@pytest.mark.parametrize("tls", ["plaintext", "wrong-ca", "wrong-name"])
def test_router_link_without_the_right_tls_fails_cleanly(tls_service, tls) -> None:
    pki = tls_service.pki
    link_tls = {"plaintext": None, "wrong-ca": ClientTLS(pki.rogue_ca),
                "wrong-name": ClientTLS(pki.ca, server_name="metadata.example.org")}[tls]
    asyncio.run(_link_fails_cleanly(tls_service.address, link_tls))


def test_plaintext_with_a_valid_token_gets_nothing(tls_service) -> None:
    """A client that would send the token in the clear never gets an answer: the service
    speaks only TLS."""
    with grpc.insecure_channel(tls_service.address) as channel:
        stub = pb_grpc.MetadataServiceStub(channel)
        auth = (("authorization", f"Bearer {SERVICE_TOKEN}"),)
        with pytest.raises(grpc.RpcError) as err:
            stub.ListNodes(pb.ListNodesRequest(), timeout=2, metadata=auth)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as err:
            next(iter(stub.WatchBlocks(pb.WatchBlocksRequest(), timeout=2, metadata=auth)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_does_not_replace_the_token(tls_service) -> None:
    ca = tls_service.pki.ca
    for token in (None, "wrong"):
        with MetadataClient(tls_service.address, token=token, tls_ca_file=ca) as c, \
                pytest.raises(MetadataAuthError, match="UNAUTHENTICATED"):
            next(iter(c.watch_nodes()))


# -- mTLS ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cert", ["none", "rogue"])
@pytest.mark.parametrize("call", ["ping", "list_nodes", "register", "watch_nodes"])
def test_mtls_refuses_a_client_without_a_trusted_certificate(mtls_service, cert, call) -> None:
    """Refused at the handshake, whatever the call and even with a valid token."""
    pki = mtls_service.pki
    keys = {"none": {}, "rogue": {"tls_cert_file": pki.rogue_cert,
                                  "tls_key_file": pki.rogue_key}}[cert]
    args = {"register": (make_node_info("p0", "prefill"), 5)}.get(call, ())
    with MetadataClient(mtls_service.address, token=node_token("p0"), tls_ca_file=pki.ca,
                        timeout_s=2, **keys) as c, pytest.raises(MetadataUnavailable):
        result = getattr(c, call)(*args)
        if call == "watch_nodes":
            next(iter(result))
    with MetadataClient(mtls_service.address, token=SERVICE_TOKEN, tls_ca_file=pki.ca,
                        tls_cert_file=pki.client_cert, tls_key_file=pki.client_key) as c:
        assert "p0" not in {n.node_id for n in c.list_nodes()}, "a refused call did no work"


def test_mtls_client_certificate_and_token_work_together(mtls_service) -> None:
    pki = mtls_service.pki
    certified = {"tls_ca_file": pki.ca, "tls_cert_file": pki.client_cert,
                 "tls_key_file": pki.client_key}
    with MetadataClient(mtls_service.address, **certified) as c, \
            pytest.raises(MetadataAuthError, match="UNAUTHENTICATED"):
        c.ping()  # a certificate is not a credential for calls
    with MetadataClient(mtls_service.address, token=SERVICE_TOKEN, **certified) as c:
        c.ping()
        with pytest.raises(MetadataAuthError, match="PERMISSION_DENIED"):
            c.register(make_node_info("d0", "decode"), 5)  # the router's token, not a node's


def test_router_link_and_node_over_mtls(mtls_service) -> None:
    pki = mtls_service.pki
    publisher, client = register_node(node_config(mtls_service, "p-mtls", client_cert=True))
    try:
        asyncio.run(_link_works(mtls_service.address,
                                ClientTLS(pki.ca, pki.client_cert, pki.client_key), "p-mtls"))
        asyncio.run(_link_fails_cleanly(mtls_service.address, ClientTLS(pki.ca)))
        asyncio.run(_link_fails_cleanly(mtls_service.address,
                                        ClientTLS(pki.ca, pki.rogue_cert, pki.rogue_key)))
    finally:
        publisher.deregister()
        client.close()


def test_node_without_a_client_certificate_cannot_register(mtls_service) -> None:
    with pytest.raises(MetadataUnavailable):
        register_node(node_config(mtls_service, "p-nocert", client_cert=False))


def test_node_runtime_registers_over_mtls(mtls_service, model_dirs) -> None:
    """A real node (engine, node server, event publisher) with its TLS settings from
    NodeConfig: registered under its own principal, deregistered at stop."""
    from pdcluster.node.runtime import NodeRuntime

    pki = mtls_service.pki
    engine = EngineConfig(model_dirs["llama-gqa"], num_kv_blocks=32, block_size=8)
    config = NodeConfig(node_id="d-runtime", role="decode", engine=engine,
                        metadata_address=mtls_service.address,
                        bootstrap_token=node_token("d-runtime"), lease_ttl_s=5,
                        metadata_tls_ca=pki.ca, metadata_tls_cert=pki.client_cert,
                        metadata_tls_key=pki.client_key, metadata_tls_server_name="localhost")
    runtime = NodeRuntime(config).start()
    reader = MetadataClient(mtls_service.address, cluster_secret=TEST_SECRET, principal=SERVICE,
                            tls_ca_file=pki.ca, tls_cert_file=pki.client_cert,
                            tls_key_file=pki.client_key)
    try:
        wait_until(lambda: "d-runtime" in {n.node_id for n in reader.list_nodes()},
                   what="the node registered over mTLS")
        node = next(n for n in reader.list_nodes() if n.node_id == "d-runtime")
        assert node.request_address == runtime.server.address
    finally:
        runtime.stop(drain=False, timeout_s=5)
    assert "d-runtime" not in {n.node_id for n in reader.list_nodes()}
    reader.close()


@pytest.mark.slow
def test_cluster_config_tls_reaches_the_node_actors(mtls_service, model_dirs) -> None:
    """What `pdcluster serve --metadata ... --metadata-tls-*` and cluster.yaml build: the node
    actors on a real local Ray get the files and register over mTLS; the router's config
    built from the same ClusterConfig reads them back."""
    from pdcluster.cluster.config import ClusterConfig
    from pdcluster.cluster.launch import router_config
    from pdcluster.cluster.ray_cluster import RayCluster

    pki = mtls_service.pki
    config = ClusterConfig(model=model_dirs["llama-gqa"], num_prefill=1, num_decode=1,
                           engine={"num_kv_blocks": 32, "block_size": 8}, node_cpus=0.5,
                           metadata_address=mtls_service.address, metadata_tls_ca=pki.ca,
                           metadata_tls_cert=pki.client_cert, metadata_tls_key=pki.client_key)
    cluster = RayCluster(config, cluster_secret=TEST_SECRET).start()
    try:
        async def router_lists_nodes() -> set[str]:
            router = router_config(config, cluster.metadata_address, TEST_SECRET)
            link = MetadataLink(router.metadata_address, token=SERVICE_TOKEN,
                                tls=router.metadata_tls, mirror=False)
            try:
                return {n.node_id for n in await link.list_nodes() or []}
            finally:
                await link.close()

        wait_until(lambda: asyncio.run(router_lists_nodes()) >= {"p0", "d0"}, timeout_s=60,
                   interval_s=0.5, what="both node actors registered over mTLS")
    finally:
        cluster.stop(drain_timeout_s=10)
