"""A node's KV identity (core.kv_identity) through the real metadata service: registered with
the node, listed back whole to the router (memory backend), kept across a restart (etcd
backend), and bounded in size like every field a node chooses."""

from __future__ import annotations

import pytest

from pdcluster.core.kv_identity import KVIdentity
from pdcluster.metadata_service.client import MetadataClient, make_node_info, node_identity
from pdcluster.metadata_service.errors import MetadataRequestError
from pdcluster.metadata_service.server import ServerThread
from tests.metadata_service.helpers import EtcdProcess, make_config, wait_until

IDENTITY = KVIdentity(32, "vllm_sha256_cbor", "vllm-none-hash", "SmolLM2-135M-Instruct",
                      "sha256:" + "ab" * 32)


def register(client: MetadataClient, node_id: str, identity: KVIdentity | None,
             port: int = 9000) -> None:
    client.register(make_node_info(node_id, "decode", request_address=f"tcp://127.0.0.1:{port}",
                                   identity=identity), 30)


def identities(client: MetadataClient) -> dict[str, KVIdentity]:
    return {n.node_id: node_identity(n) for n in client.list_nodes()}


def test_the_registry_lists_each_nodes_identity(client: MetadataClient) -> None:
    register(client, "d0", IDENTITY)
    register(client, "old", None, 9001)  # a node that declares none: all fields empty
    assert identities(client) == {"d0": IDENTITY, "old": KVIdentity(0, "", "", "", "")}


def test_the_identity_survives_a_restart_with_etcd(etcd: EtcdProcess) -> None:
    config = make_config(backend="etcd", etcd_endpoints=(etcd.endpoint,))
    with ServerThread(config) as server, MetadataClient(server.address) as client:
        register(client, "d0", IDENTITY)
        wait_until(lambda: client.stats().persistence_pending_nodes == 0, what="etcd write")
    with ServerThread(config) as server, MetadataClient(server.address) as client:
        assert identities(client) == {"d0": IDENTITY}


@pytest.mark.parametrize("field", ["hash_algorithm", "hash_seed", "tokenizer_digest"])
def test_an_oversized_identity_field_is_refused(client: MetadataClient, field: str) -> None:
    info = make_node_info("d0", "decode", request_address="tcp://127.0.0.1:9", identity=IDENTITY)
    setattr(info, field, "x" * 257)
    with pytest.raises(MetadataRequestError, match=field):
        client.register(info, 30)
    assert client.list_nodes() == []
