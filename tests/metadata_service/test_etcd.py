"""The etcd backend against a real etcd on loopback: leases, recovery, replicas, outages."""

from __future__ import annotations

import time

from pdcluster.core.events import AllBlocksCleared
from pdcluster.metadata_service.client import MetadataClient
from pdcluster.metadata_service.server import ServerThread
from tests.metadata_service.helpers import (
    EtcdProcess,
    FakeNode,
    make_chain,
    make_config,
    make_publisher,
    wait_until,
)

CHAIN = make_chain("etcd", 40)


def etcd_config(etcd: EtcdProcess, **overrides):
    return make_config(backend="etcd", etcd_endpoints=(etcd.endpoint,), **overrides)


def index_view(server: ServerThread) -> dict[str, tuple[int, frozenset]]:
    """node -> (seq, block set), read on the server's loop."""
    def read(service):
        return {n: (service._nodes[n].seq, service.index.node_blocks(n))
                for n in service.index.node_ids}
    return server.call(read)


def settled(client: MetadataClient) -> bool:
    stats = client.stats()
    return stats.healthy and stats.persistence_pending_nodes == 0


def leading(node: FakeNode, chain=CHAIN) -> int:
    depth = 0
    while depth < len(chain) and chain[depth] in node.cached:
        depth += 1
    return depth


def run_traffic(publisher, node: FakeNode, start: int, stop: int) -> None:
    for i in range(start, stop, 4):
        publisher.publish([node.store(CHAIN[i:i + 4])])
        if i % 12 == 8:
            publisher.publish([node.evict(CHAIN[i - 4:i - 2])])


def test_restart_recovers_the_exact_index_from_etcd(etcd: EtcdProcess) -> None:
    config = etcd_config(etcd, compact_after_deltas=3)
    with ServerThread(config) as server, MetadataClient(server.address) as client:
        p0, p0_node = make_publisher(client, "p0", ttl=30)
        d0, d0_node = make_publisher(client, "d0", "decode", ttl=30)
        run_traffic(p0, p0_node, 0, 40)
        run_traffic(d0, d0_node, 0, 16)
        d0.publish([AllBlocksCleared()])
        d0_node.cached.clear()
        d0.publish([d0_node.store(CHAIN[:3])])
        wait_until(lambda: settled(client), what="persistence to drain")
        before = index_view(server)
        assert client.stats().etcd_writes > 0
    assert before["p0"][1] == p0_node.cached and before["d0"][1] == d0_node.cached
    with ServerThread(config) as server, MetadataClient(server.address) as client:
        assert index_view(server) == before, "rebuilt at start, without any node's help"
        assert client.query(CHAIN[:3]) == [("d0", 3), ("p0", 3)]
        p0.client = client
        assert p0.publish([p0_node.evict(CHAIN[:1])]) == 0, "seq continues: no resync"
        assert p0.num_resyncs == 0


def test_lease_expiry_removes_node_blocks_everywhere(etcd: EtcdProcess) -> None:
    with ServerThread(etcd_config(etcd)) as server, MetadataClient(server.address) as client:
        publisher, node = make_publisher(client, "p0", ttl=2)
        publisher.publish([node.store(CHAIN[:5])])
        wait_until(lambda: settled(client), what="persistence")
        assert "p0" in etcd.etcdctl("get", "--prefix", "--keys-only", "/pdcluster")
        wait_until(lambda: not client.list_nodes(), timeout_s=8, what="etcd lease expiry")
        assert client.query(CHAIN) == [] and client.stats().num_blocks == 0
        assert etcd.etcdctl("get", "--prefix", "--keys-only", "/pdcluster").strip() == ""


def test_heartbeats_keep_the_etcd_lease_alive(etcd: EtcdProcess) -> None:
    with ServerThread(etcd_config(etcd)) as server, MetadataClient(server.address) as client:
        publisher, node = make_publisher(client, "p0", ttl=2)
        publisher.publish([node.store(CHAIN[:2])])
        for _ in range(12):  # 3.6 s, well past the TTL
            assert publisher.heartbeat()
            time.sleep(0.3)
        assert client.query(CHAIN) == [("p0", 2)]


def test_two_replicas_agree(etcd: EtcdProcess) -> None:
    with ServerThread(etcd_config(etcd, replica_id="a")) as a, \
            ServerThread(etcd_config(etcd, replica_id="b")) as b, \
            MetadataClient(a.address) as client_a, MetadataClient(b.address) as client_b:
        p0, p0_node = make_publisher(client_a, "p0", ttl=2)
        d0, d0_node = make_publisher(client_b, "d0", "decode", ttl=30)
        run_traffic(p0, p0_node, 0, 24)
        run_traffic(d0, d0_node, 8, 32)
        wait_until(lambda: index_view(a) == index_view(b) and len(index_view(a)) == 2,
                   what="the replicas to converge")
        assert index_view(a)["p0"][1] == p0_node.cached
        assert client_a.query(CHAIN) == client_b.query(CHAIN)
        assert client_b.query(CHAIN[8:]) == client_a.query(CHAIN[8:])
        # p0 stops heartbeating: its etcd lease expires, and BOTH replicas drop it.
        for _ in range(20):
            d0.heartbeat()
            if len(client_b.list_nodes()) == 1 and len(client_a.list_nodes()) == 1:
                break
            time.sleep(0.25)
        assert [n.node_id for n in client_a.list_nodes()] == ["d0"]
        assert [n.node_id for n in client_b.list_nodes()] == ["d0"]
        assert index_view(a) == index_view(b)


def test_etcd_outage_keeps_queries_working_and_reconciles(etcd: EtcdProcess) -> None:
    config = etcd_config(etcd)
    with ServerThread(config) as server, MetadataClient(server.address) as client:
        p0, p0_node = make_publisher(client, "p0", ttl=30)
        run_traffic(p0, p0_node, 0, 12)
        wait_until(lambda: settled(client), what="persistence")
        etcd.stop()
        wait_until(lambda: not client.stats().healthy, what="degraded health")
        stats = client.stats()
        assert stats.etcd_status.startswith("unreachable") and "queue" in stats.persistence_policy
        assert client.query(CHAIN) == [("p0", leading(p0_node))], "queries work from memory"
        run_traffic(p0, p0_node, 12, 28)
        d0, d0_node = make_publisher(client, "d0", "decode", ttl=30)
        d0.publish([d0_node.store(CHAIN[:6])])
        assert client.query(CHAIN, include_zero=True) == sorted(
            [("p0", leading(p0_node)), ("d0", 6)], key=lambda m: (-m[1], m[0]))
        assert client.stats().persistence_pending_nodes == 2
        etcd.start()
        wait_until(lambda: settled(client), timeout_s=20, what="reconciliation")
        expected = index_view(server)
    with ServerThread(config) as server:
        assert index_view(server) == expected, "etcd holds what was queued during the outage"
    assert expected["p0"][1] == p0_node.cached and expected["d0"][1] == d0_node.cached
