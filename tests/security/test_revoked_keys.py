"""A revoked key on a live CURVE connection, against a real prefill node (engine, node server,
its own key, registered with a real metadata service): member m0 connects with its registered
key, then its registration ends (it deregisters; the node's directory lets the key go).

- The node closes m0's connection when its directory drops the key (core.connections): m0's
  later messages never reach the node, and its reconnects are refused by ZAP. Before, the
  connection lived on and each message on it was refused one by one.
- A connection that had sent nothing before the key left is closed at its first message, which
  is refused at once, without asking the metadata service again (before the per-message path
  stopped refreshing, each such message cost the engine thread ~0.2 s).
A router's load query on the same socket is answered meanwhile."""

from __future__ import annotations

import time

import pytest
import zmq

from pdcluster.core.credentials import CurveKeys
from pdcluster.core.curve import authenticator_for
from pdcluster.core.node_wire import LoadQuery, LoadReport
from pdcluster.core.node_wire import encode as encode_node
from pdcluster.engine.config import EngineConfig
from pdcluster.metadata_service.client import MetadataClient, make_node_info
from pdcluster.node.config import NodeConfig
from pdcluster.node.runtime import NodeRuntime
from tests.cluster_secret import TEST_SECRET, node_token
from tests.identity import router_clients
from tests.security.attacks import dealer

pytestmark = pytest.mark.slow
MESSAGES = 10


def _wait(predicate, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.005)
    return time.monotonic() - start


@pytest.fixture
def node_and_member(model_dirs):
    """A prefill node, a router client of it, and member m0's key registered under a live
    metadata client (the test deregisters it)."""
    from pdcluster.metadata_service.server import ServerThread
    from tests.metadata_service.helpers import make_config

    engine = EngineConfig(model_dirs["llama-gqa"], num_kv_blocks=64, block_size=8)
    with ServerThread(make_config(cluster_secret=TEST_SECRET)) as service:
        node = NodeRuntime(NodeConfig(node_id="p0", role="prefill", engine=engine,
                                      metadata_address=service.address,
                                      bootstrap_token=node_token("p0"))).start()
        router = router_clients(service.address, TEST_SECRET, {"p0": node.server.address})["p0"]
        member = CurveKeys.generate()
        node.directory._grace_s = 0.0  # a key leaves at the next refresh, not 15 s later
        try:
            with MetadataClient(service.address, token=node_token("m0")) as m0:
                proof = m0.register(make_node_info("m0", "decode", curve_public_key=member.public,
                                                   kv_address="tcp://127.0.0.1:9"), 300)
                yield node, router, member, lambda: m0.deregister("m0",
                                                                  proof.registration_secret)
        finally:
            router.close()
            node.stop(drain=False, timeout_s=5)


def _revoke(node, deregister) -> None:
    deregister()
    node.directory.refresh_now(force=True)
    assert node.directory.peer("node/m0") is None


def _member_socket(node, member):
    sock = dealer(node.server.address, member, node.keys.public)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def test_a_revoked_keys_connection_is_closed_and_its_reconnects_refused(node_and_member):
    node, router, member, deregister = node_and_member
    stats, connections = node.server.stats, node.server._connections
    denied = authenticator_for(zmq.Context.instance())
    sock = _member_socket(node, member)
    try:
        sock.send(encode_node(LoadQuery()))  # forbidden (not a router): connected, noted
        _wait(lambda: stats.num_forbidden == 1, 10, "the member's handshake")
        denied_before = denied.num_denied
        _revoke(node, deregister)
        assert connections.num_closed == 1  # at the refresh that dropped the key
        for _ in range(MESSAGES):
            sock.send(encode_node(LoadQuery()))
        router.send(LoadQuery())
        assert isinstance(router.recv(5), LoadReport)  # the router is served meanwhile
        _wait(lambda: denied.num_denied > denied_before, 10, "a refused reconnect")
        time.sleep(0.5)
        assert stats.num_forbidden == 1  # nothing more arrived from the revoked key
    finally:
        sock.close()


def test_a_revoked_keys_first_message_is_refused_at_once_and_closes_it(node_and_member):
    node, router, member, deregister = node_and_member
    stats, connections = node.server.stats, node.server._connections
    sock = _member_socket(node, member)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        assert monitor.poll(10_000), "the member's handshake"  # connected, nothing sent
        _revoke(node, deregister)
        assert connections.num_closed == 0  # it never sent: not known to the node yet
        refreshes = node.directory.num_refreshes
        sock.send(encode_node(LoadQuery()))
        router.send(LoadQuery())
        elapsed = _wait(lambda: stats.num_forbidden == 1, 10, "the refusal")
        assert isinstance(router.recv(5), LoadReport)
        assert elapsed < 0.5, f"the refusal took {elapsed:.2f} s"
        _wait(lambda: connections.num_closed == 1, 5, "the connection to be closed")
        assert node.directory.num_refreshes - refreshes <= 1  # the follower's own, at most
        sock.send(encode_node(LoadQuery()))
        time.sleep(0.5)
        assert stats.num_forbidden == 1
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close()
