"""The cluster secret tests give every node, router and metadata service they build (nothing
serves without one), and the tokens derived from it."""

from __future__ import annotations

from pdcluster.core.credentials import SERVICE, ClusterSecret, node_principal

TEST_SECRET = ClusterSecret(bytes(range(32)))
SERVICE_TOKEN = TEST_SECRET.metadata_token(SERVICE)


def node_token(node_id: str) -> str:
    return TEST_SECRET.metadata_token(node_principal(node_id))
TEST_CURVE = TEST_SECRET.curve_keys()  # the ZMQ CURVE key pair derived from it


def node_credentials(node_id: str) -> dict:
    """A NodeConfig's credential: the node's own bootstrap token for the metadata service. In
    the shared-key test mode the node also gets `NodeRuntime(config, shared_keys=TEST_CURVE)`."""
    return {"bootstrap_token": node_token(node_id)}


# A RouterConfig's credential; in the shared-key test mode the router also gets
# `RouterApp(config, shared_keys=TEST_CURVE)` (or `Dispatcher(..., shared_keys=TEST_CURVE)`).
ROUTER_CREDENTIALS = {"metadata_token": SERVICE_TOKEN}
