"""A revoked key on a live CURVE connection, against a real prefill node (engine, node server,
its own key, registered with a real metadata service): member m0 connects with its registered
key, then its registration ends (it deregisters; the node's directory lets the key go). Each
message m0 then sends on its open connection names nobody. The node refuses each at once,
without asking the metadata service again: before, every such message cost the
node's engine thread a blocking directory refresh (~0.2 s), so a trickle of them stalled every
request on the node. A router's load query on the same socket is answered meanwhile."""

from __future__ import annotations

import time

import pytest
import zmq

from pdcluster.core.credentials import CurveKeys
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


def test_messages_from_a_revoked_key_are_refused_without_stalling_the_node(model_dirs):
    from pdcluster.metadata_service.server import ServerThread
    from tests.metadata_service.helpers import make_config

    engine = EngineConfig(model_dirs["llama-gqa"], num_kv_blocks=64, block_size=8)
    with ServerThread(make_config(cluster_secret=TEST_SECRET)) as service:
        node = NodeRuntime(NodeConfig(node_id="p0", role="prefill", engine=engine,
                                      metadata_address=service.address,
                                      bootstrap_token=node_token("p0"))).start()
        router = router_clients(service.address, TEST_SECRET, {"p0": node.server.address})["p0"]
        member = CurveKeys.generate()
        sock = None
        try:
            with MetadataClient(service.address, token=node_token("m0")) as m0:
                proof = m0.register(make_node_info("m0", "decode", curve_public_key=member.public,
                                                   kv_address="tcp://127.0.0.1:9"), 300)
                sock = dealer(node.server.address, member, node.keys.public)
                sock.setsockopt(zmq.LINGER, 0)
                stats = node.server.stats
                sock.send(encode_node(LoadQuery()))  # forbidden (not a router): connected
                _wait(lambda: stats.num_forbidden == 1, 10, "the member's handshake")
                m0.deregister("m0", proof.registration_secret)
            directory = node.directory
            directory._grace_s = 0.0  # the key leaves at the next refresh, not 15 s later
            directory.refresh_now(force=True)
            assert directory.peer("node/m0") is None
            refreshes = directory.num_refreshes
            for _ in range(MESSAGES):
                sock.send(encode_node(LoadQuery()))
            router.send(LoadQuery())
            elapsed = _wait(lambda: stats.num_forbidden == 1 + MESSAGES, 10,
                            "the revoked key's messages to be refused")
            assert isinstance(router.recv(5), LoadReport)  # the router is served meanwhile
            assert elapsed < 0.5, f"{MESSAGES} refusals took {elapsed:.2f} s"
            assert directory.num_refreshes - refreshes <= 1  # the follower's own, at most
        finally:
            if sock is not None:
                sock.close()
            router.close()
            node.stop(drain=False, timeout_s=5)
