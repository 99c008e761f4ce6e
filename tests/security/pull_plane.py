"""The plane tests/security/test_pull_tickets.py attacks (and benchmarks/pull_ticket_bench.py
measures): a real metadata service; holder h0 and puller p0 (engine, node server, their own
keys, Mooncake over TCP on 127.0.0.1); a registered router's ticket signer and clients; and
member m0, a registered decode node with its own key, side channel and Mooncake memory,
which sends its own pulls (`member_pull`)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

from pdcluster.core.credentials import SERVICE, CurveKeys
from pdcluster.core.identity import Directory
from pdcluster.core.kv_transfer import PrefixPullRequest
from pdcluster.core.kv_transfer import encode as encode_kv
from pdcluster.engine.config import EngineConfig
from pdcluster.metadata_service.client import MetadataClient, make_node_info
from pdcluster.node.client import BlockingNodeClient
from pdcluster.node.config import NodeConfig
from pdcluster.node.runtime import NodeRuntime, registered_peers
from pdcluster.transfer.side_channel import SideChannelServer
from tests.cluster_secret import TEST_SECRET, node_token
from tests.identity import node_keys, registered_signer
from tests.security.served import Memory, block_nbytes, dealer

BLOCK = 8
NUM_BLOCKS = 4


class _Inbox:
    """Member m0's side channel: where holders send its XferDone."""

    def __init__(self, keys: CurveKeys, directory) -> None:
        self.messages: list = []
        self._server = SideChannelServer(self.messages.append, curve=keys, directory=directory)
        self.address = self._server.address

    def wait(self, timeout_s: float = 10.0) -> list:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.messages:
            time.sleep(0.0005)  # fine-grained: benchmarks time the round trip
        messages, self.messages[:] = list(self.messages), []
        return messages

    def close(self) -> None:
        self._server.close()


@contextmanager
def pull_plane(model: str) -> Iterator[SimpleNamespace]:
    from pdcluster.metadata_service.server import ServerThread
    from tests.metadata_service.helpers import make_config

    engine = EngineConfig(model, num_kv_blocks=64, block_size=BLOCK)
    with ServerThread(make_config(cluster_secret=TEST_SECRET)) as service:
        nodes = {node_id: NodeRuntime(NodeConfig(
            node_id=node_id, role="prefill", engine=engine, metadata_address=service.address,
            bootstrap_token=node_token(node_id), kv_timeout_s=10.0)).start()
            for node_id in ("h0", "p0")}
        keys, signer = registered_signer(service.address, TEST_SECRET)
        server_keys = node_keys(service.address, TEST_SECRET)
        clients = {node_id: BlockingNodeClient(node.server.address, curve=keys,
                                               server_key=server_keys[node_id])
                   for node_id, node in nodes.items()}
        reader = MetadataClient(service.address, token=TEST_SECRET.metadata_token(SERVICE))
        directory = Directory(refresh=lambda: registered_peers(reader), min_refresh_s=0.05)
        member_keys, memory = CurveKeys.generate(), Memory(NUM_BLOCKS * block_nbytes(model,
                                                                                    BLOCK))
        inbox = _Inbox(member_keys, directory)
        with MetadataClient(service.address, token=node_token("m0")) as m0:
            m0.register(make_node_info("m0", "decode", kv_address=inbox.address,
                                       kv_session=memory.engine.session_id,
                                       curve_public_key=member_keys.public), 300)
        for node in nodes.values():  # every directory of this process knows m0 from here on
            node.directory.refresh_now(force=True)
        try:
            yield SimpleNamespace(nodes=nodes, clients=clients, signer=signer, model=model,
                                  server_keys=server_keys, member_keys=member_keys,
                                  memory=memory, inbox=inbox,
                                  nbytes=block_nbytes(model, BLOCK))
        finally:
            for client in clients.values():
                client.close()
            inbox.close()
            memory.close()
            reader.close()
            for node in nodes.values():
                node.stop(drain=False)


def counters(node: NodeRuntime) -> dict:
    return node.server.call(lambda engine: engine.transfer_counters())


def member_pull(plane, holder: str, prompt: list[int], ticket=None, salt=None):
    """m0's own PrefixPullRequest for the first NUM_BLOCKS blocks of `prompt`, straight to
    `holder`'s side channel: (its XferDone, whether any byte landed in m0's memory)."""
    plane.memory.buf[:] = 0
    sock = dealer(plane.nodes[holder].kv_address, plane.member_keys,
                  plane.server_keys[holder])
    nbytes = plane.nbytes
    sock.send(encode_kv(PrefixPullRequest(
        f"pull-{secrets.token_hex(4)}", "r", plane.inbox.address,
        plane.memory.engine.session_id, nbytes, BLOCK, 0, prompt[:NUM_BLOCKS * BLOCK],
        [plane.memory.addr(i * nbytes) for i in range(NUM_BLOCKS)], cache_salt=salt,
        ticket=ticket)))
    (done,) = plane.inbox.wait()
    sock.close()
    return done, plane.memory.touched
