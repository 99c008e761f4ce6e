"""Test helpers for per-workload identity (core.identity): talking to nodes that run with
their own keys, as a registered router does."""

from __future__ import annotations

import secrets

from pdcluster.core.credentials import SERVICE, ClusterSecret, CurveKeys
from pdcluster.metadata_service.client import MetadataClient
from pdcluster.node.client import BlockingNodeClient


def registered_router(metadata_address: str, secret: ClusterSecret) -> CurveKeys:
    """A fresh router key pair, registered with the router's credential."""
    keys = CurveKeys.generate()
    with MetadataClient(metadata_address, token=secret.metadata_token(SERVICE)) as client:
        client.register_client(f"test-{secrets.token_hex(4)}", keys.public, 600)
    return keys


def node_keys(metadata_address: str, secret: ClusterSecret) -> dict[str, bytes]:
    """Each live node's public key, as the metadata service publishes it."""
    with MetadataClient(metadata_address, token=secret.metadata_token(SERVICE)) as client:
        return {n.node_id: n.curve_public_key.encode() for n in client.list_nodes()}


def router_clients(metadata_address: str, secret: ClusterSecret,
                   nodes: dict[str, str]) -> dict[str, BlockingNodeClient]:
    """A blocking client per node id (of `nodes`: id -> request address), as a registered
    router."""
    keys, server_keys = registered_router(metadata_address, secret), node_keys(
        metadata_address, secret)
    return {node_id: BlockingNodeClient(address, curve=keys, server_key=server_keys[node_id])
            for node_id, address in nodes.items()}
