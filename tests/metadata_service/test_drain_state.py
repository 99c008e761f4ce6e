"""A draining node in the index: its heartbeat says it is leaving, the index lists it as
draining (on every replica sharing etcd, and to node watchers) and keeps its blocks, which
peers still pull from it; a registration that differs only in that state is a plain refresh."""

from __future__ import annotations

import asyncio

from pdcluster.metadata_service.client import MetadataClient, make_node_info
from pdcluster.metadata_service.server import ServerThread
from pdcluster.proto import metadata_pb2 as pb
from tests.cluster_secret import SERVICE_TOKEN, TEST_SECRET, node_token
from tests.metadata_service.helpers import EtcdProcess, make_chain, make_config, wait_until
from tests.metadata_service.test_service import make_service, stored

CHAIN = make_chain("drain", 4)


def draining(nodes: list[pb.NodeInfo]) -> dict[str, bool]:
    return {n.node_id: n.draining for n in nodes}


def test_a_draining_heartbeat_marks_the_node_and_keeps_its_blocks() -> None:
    async def scenario() -> list[tuple[int, str, bool]]:
        service, store, _ = make_service()
        info = make_node_info("d0", "decode", epoch=7)
        service.register(info, 2)
        service.publish("d0", 7, 1, stored(CHAIN))
        watch = service.node_watch.subscribe(service.list_nodes())
        assert service.heartbeat("d0", 7) and not service.list_nodes()[0].draining
        assert service.heartbeat("d0", 7, draining=True)
        assert draining(service.list_nodes()) == {"d0": True}
        assert store.calls[-1] == ("up", "d0", False)  # to the other replicas, not a restart
        assert service.query(b"".join(CHAIN)) == [("d0", 4)]  # peers still pull from it
        again = pb.NodeInfo()
        again.CopyFrom(info)
        again.draining = True  # re-registering while draining: the same incarnation
        assert service.register_node(again, 2)[2] == b""
        assert service.query(b"".join(CHAIN)) == [("d0", 4)]
        service.heartbeat("d0", 7, draining=True)  # no change: nobody is told again
        return [(c.kind, c.node.node_id, c.node.draining)
                for c in [watch.get_nowait() for _ in range(watch.qsize())]]

    up = pb.NodeChange.UP
    assert asyncio.run(scenario()) == [(up, "d0", False), (up, "d0", True), (up, "d0", True)]


def test_every_replica_lists_the_node_as_draining(etcd: EtcdProcess) -> None:
    def replica(name: str) -> ServerThread:
        return ServerThread(make_config(backend="etcd", etcd_endpoints=(etcd.endpoint,),
                                        cluster_secret=TEST_SECRET, replica_id=name))

    def listed(server: ServerThread) -> dict[str, bool]:
        with MetadataClient(server.address, token=SERVICE_TOKEN) as reader:
            return draining(reader.list_nodes())

    with replica("a") as a, replica("b") as b, \
            MetadataClient(a.address, token=node_token("d0")) as d0:
        d0.register(make_node_info("d0", "decode", epoch=5), 30)
        wait_until(lambda: listed(b) == {"d0": False}, what="b to know d0")
        assert d0.heartbeat("d0", 5, draining=True)
        wait_until(lambda: listed(a) == listed(b) == {"d0": True}, what="d0 draining on both")
