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
    """A NodeConfig's credentials in the shared-key test mode: the shared pair, and the node's
    own bootstrap token for the metadata service."""
    return {"shared_curve": TEST_CURVE, "bootstrap_token": node_token(node_id)}


# A RouterConfig's credentials in the shared-key test mode.
ROUTER_CREDENTIALS = {"shared_curve": TEST_CURVE, "metadata_token": SERVICE_TOKEN}
