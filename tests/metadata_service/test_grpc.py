"""The gRPC server and the sync/async clients on 127.0.0.1 (memory backend)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdcluster.benchmarks.ports import free_port
from pdcluster.metadata_service.client import AsyncMetadataClient, MetadataClient, make_node_info
from pdcluster.metadata_service.errors import MetadataRequestError, MetadataUnavailable
from pdcluster.metadata_service.publisher import AsyncNodePublisher, NodePublisher
from pdcluster.metadata_service.server import ServerThread
from pdcluster.proto import metadata_pb2 as pb
from tests.metadata_service.helpers import (
    FakeNode,
    make_chain,
    make_config,
    make_publisher,
    wait_until,
)

CHAIN = make_chain("grpc", 10)


def test_register_publish_query_list(client: MetadataClient) -> None:
    publisher, node = make_publisher(client)
    decoder, decode_node = make_publisher(client, "d0", "decode")
    assert publisher.publish([node.store(CHAIN[:6])]) == pb.PublishReply.OK
    decoder.publish([decode_node.store(CHAIN[:2])])
    assert client.query(CHAIN) == [("p0", 6), ("d0", 2)]
    assert client.query(CHAIN, role="decode") == [("d0", 2)]
    assert client.query(CHAIN, node_ids=["d0"]) == [("d0", 2)]
    assert client.query(make_chain("other", 3), include_zero=True) == [("d0", 0), ("p0", 0)]
    assert [n.node_id for n in client.list_nodes()] == ["d0", "p0"]
    assert [n.node_id for n in client.list_nodes("prefill")] == ["p0"]
    stats = client.stats()
    assert (stats.num_nodes, stats.num_blocks, stats.num_entries) == (2, 6, 8)
    assert stats.backend == "memory" and stats.healthy and stats.etcd_status == "disabled"
    client.ping()


def test_lost_batch_triggers_resync_and_index_is_exact(client: MetadataClient) -> None:
    publisher, node = make_publisher(client)
    publisher.publish([node.store(CHAIN[:3])])
    publisher.seq += 1  # this batch never reaches the service
    node.store(CHAIN[3:8])
    node.evict(CHAIN[:1])
    assert publisher.publish([node.store(CHAIN[8:])]) == pb.PublishReply.RESYNC_NEEDED
    assert publisher.num_resyncs == 1
    assert client.query(CHAIN) == [], "block 0 was evicted in the lost batch"
    assert client.query(CHAIN[1:]) == [("p0", 9)]
    assert client.stats().num_blocks == len(node.cached) == 9


def test_service_restart_is_answered_with_a_snapshot() -> None:
    port = free_port()
    node = FakeNode()
    with ServerThread(make_config(port=port)) as server, MetadataClient(server.address) as c:
        publisher = NodePublisher(c, make_node_info("p0", "prefill"), lambda: node.cached, 5)
        publisher.register()
        publisher.publish([node.store(CHAIN[:4])])
    with ServerThread(make_config(port=port)), MetadataClient(f"127.0.0.1:{port}") as c:
        publisher.client = c
        assert publisher.publish([node.store(CHAIN[4:5])]) == pb.PublishReply.UNKNOWN_NODE
        assert c.query(CHAIN) == [("p0", 5)]


def test_malformed_batch_error_is_precise_over_grpc(client: MetadataClient) -> None:
    make_publisher(client)
    bad = pb.PublishRequest(node_id="p0", epoch=1, seq=1, events=[
        pb.KVEventMsg(stored=pb.BlockStoredEvent(block_hashes=b"x" * 40))])
    with pytest.raises(MetadataRequestError, match="INVALID_ARGUMENT.*bad_hash_length: event 0 "
                       "block_hashes has 40 bytes, not a multiple of the 32-byte hash size"):
        client.publish_raw(bad)
    assert dict(client.stats().rejected_by_reason) == {"bad_hash_length": 1}


def test_oversize_batch_is_rejected() -> None:
    with ServerThread(make_config(max_batch_hashes=4)) as server, \
            MetadataClient(server.address) as c:
        publisher, node = make_publisher(c)
        with pytest.raises(MetadataRequestError, match="too_many_hashes"):
            publisher.publish([node.store(CHAIN[:5])])
        assert c.stats().rejected_by_reason["too_many_hashes"] == 1


def test_lease_expiry_over_grpc(client: MetadataClient) -> None:
    publisher, node = make_publisher(client, ttl=1)
    publisher.publish([node.store(CHAIN[:3])])
    assert publisher.heartbeat()
    wait_until(lambda: not client.list_nodes(), timeout_s=5, what="the lease to expire")
    assert client.query(CHAIN) == [] and client.stats().num_blocks == 0
    assert not publisher.heartbeat(), "an expired node registers again"
    assert client.query(CHAIN) == [("p0", 3)], "...and resyncs its blocks"


def test_watch_nodes_stream(client: MetadataClient) -> None:
    make_publisher(client, "p0")
    seen: list[tuple[int, str]] = []
    stream = client.watch_nodes()

    def consume() -> None:
        for change in stream:
            seen.append((change.kind, change.node.node_id))
            if len(seen) == 3:
                return

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    wait_until(lambda: seen, what="the initial UP")
    make_publisher(client, "d0", "decode")
    client.deregister("p0")
    thread.join(timeout=5)
    up, down = pb.NodeChange.UP, pb.NodeChange.DOWN
    assert seen == [(up, "p0"), (up, "d0"), (down, "p0")]
    stream.close()


def test_async_client_and_publisher(memory_server: ServerThread) -> None:
    async def scenario() -> tuple:
        client = AsyncMetadataClient(memory_server.address)
        node = FakeNode()
        publisher = AsyncNodePublisher(client, make_node_info("a0", "decode"),
                                       lambda: node.cached, 2)
        await publisher.register()
        await publisher.publish([node.store(CHAIN[:5])])
        publisher.seq += 1
        await publisher.publish([node.store(CHAIN[5:7])])
        result = (await client.query(CHAIN), publisher.num_resyncs,
                  [n.node_id for n in await client.list_nodes()],
                  (await client.stats()).num_blocks, await publisher.heartbeat())
        watch = client.watch_nodes()
        first = await watch.__anext__()
        await watch.aclose()
        await client.close()
        return (*result, first.node.node_id)

    assert asyncio.run(scenario()) == ([("a0", 7)], 1, ["a0"], 7, True, "a0")


def test_unreachable_service_is_typed() -> None:
    with MetadataClient(f"127.0.0.1:{free_port()}", timeout_s=0.5) as c, \
            pytest.raises(MetadataUnavailable):
        c.ping()
