"""Test helpers for per-workload identity (core.identity): talking to nodes that run with
their own keys, as a registered router does."""

from __future__ import annotations

import secrets

from pdcluster.core.credentials import SERVICE, ClusterSecret, CurveKeys
from pdcluster.core.identity import ROUTER_PREFIX
from pdcluster.core.pull_ticket import TicketSigner
from pdcluster.metadata_service.client import MetadataClient
from pdcluster.node.client import BlockingNodeClient


def registered_router(metadata_address: str, secret: ClusterSecret) -> CurveKeys:
    """A fresh router key pair, registered with the router's credential."""
    return registered_signer(metadata_address, secret)[0]


def registered_signer(metadata_address: str, secret: ClusterSecret,
                      ttl_s: float | None = None) -> tuple[CurveKeys, TicketSigner]:
    """A fresh router key pair and pull-ticket signer (core.pull_ticket), registered with the
    router's credential as a router registers them."""
    keys, client_id = CurveKeys.generate(), f"test-{secrets.token_hex(4)}"
    signer = TicketSigner(ROUTER_PREFIX + client_id, *(() if ttl_s is None else (ttl_s,)))
    with MetadataClient(metadata_address, token=secret.metadata_token(SERVICE)) as client:
        client.register_client(client_id, keys.public, 600, signer.public_key)
    return keys, signer


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
