"""WatchBlocks, service side: the stream's order and contents, replay equals the index (also
when changes race the snapshot), chunking, the slow-subscriber cut-off, and the wire (token,
RESOURCE_EXHAUSTED)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.core.block_index import BlockIndex
from pdcluster.metadata_service.client import MetadataClient
from pdcluster.metadata_service.server import ServerThread
from pdcluster.metadata_service.watch import CHUNK_HASHES, SubscriberTooSlow, WatchedIndex
from pdcluster.proto import metadata_pb2 as pb
from pdcluster.proto import metadata_pb2_grpc as pb_grpc
from tests.cluster_secret import SERVICE_TOKEN, TEST_SECRET
from tests.metadata_service.helpers import make_chain, make_config, make_publisher

U = pb.BlockUpdate
CHAIN = make_chain("watch", 12)


def make_index(holdings: dict[str, list[bytes]], max_pending: int = 1000) -> WatchedIndex:
    index = WatchedIndex(32, max_pending)
    for node_id, hashes in holdings.items():
        index.add_node(node_id)
        index.add_blocks(node_id, hashes)
    return index


class Follower:
    """Reads a subscriber's stream in a task on the current loop, ``limit`` messages at a time
    (never cancelling the generator: that would close it)."""

    def __init__(self, subscriber) -> None:
        self.got: list[pb.BlockUpdate] = []
        self.error: Exception | None = None
        self._allowed = 0
        self._go = asyncio.Event()
        self._updates = subscriber.updates()
        self._task = asyncio.get_event_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while True:
                while len(self.got) >= self._allowed:
                    self._go.clear()
                    await self._go.wait()
                self.got.append(await anext(self._updates))
        except Exception as exc:  # handed to the test
            self.error = exc

    def take(self, limit: int = 10**9) -> list[pb.BlockUpdate]:
        """The next messages available now, at most ``limit``."""
        start = len(self.got)
        self._allowed = start + limit
        self._go.set()
        loop = asyncio.get_event_loop()
        for _ in range(20):
            loop.run_until_complete(asyncio.sleep(0.001))
        if self.error is not None:
            raise self.error
        return self.got[start:]


def replay(updates: list[pb.BlockUpdate], into: BlockIndex | None = None) -> BlockIndex:
    """An independent oracle of what a follower does with the stream."""
    index = into or BlockIndex()
    for u in updates:
        hashes = [u.block_hashes[i:i + 32] for i in range(0, len(u.block_hashes), 32)]
        if u.kind in (U.SNAPSHOT, U.STORED):
            index.add_node(u.node_id)
            index.add_blocks(u.node_id, hashes)
        elif index.has_node(u.node_id):
            if u.kind == U.REMOVED:
                index.remove_blocks(u.node_id, hashes)
            elif u.kind == U.CLEARED:
                index.clear_node(u.node_id)
            elif u.kind == U.NODE_REMOVED:
                index.remove_node(u.node_id)
    return index


def holdings(index: BlockIndex) -> dict[str, frozenset]:
    return {n: index.node_blocks(n) for n in index.node_ids if index.num_node_blocks(n)}


def _close(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    asyncio.set_event_loop(None)


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    _close(loop)


def test_snapshot_then_every_change_in_order(loop) -> None:
    index = make_index({"a": CHAIN[:4], "b": CHAIN[:2]})
    follower = Follower(index.subscribe())
    snapshot = follower.take()
    index.add_node("c")
    index.add_blocks("c", CHAIN[:3])
    index.remove_blocks("a", CHAIN[3:4])
    index.clear_node("b")
    index.replace_node_blocks("c", CHAIN[1:5])
    index.remove_node("a")
    got = snapshot + follower.take()
    assert [(u.kind, u.node_id) for u in got] == [
        (U.SNAPSHOT, "a"), (U.SNAPSHOT, "b"), (U.SNAPSHOT_COMPLETE, ""), (U.STORED, "c"),
        (U.REMOVED, "a"), (U.CLEARED, "b"), (U.REMOVED, "c"), (U.STORED, "c"),
        (U.NODE_REMOVED, "a")]
    assert got[-3].block_hashes == CHAIN[0]  # replace's diff: -{0}, +{3, 4}
    added = got[-2].block_hashes
    assert {added[i:i + 32] for i in range(0, len(added), 32)} == set(CHAIN[3:5])
    assert all(u.hash_size == 32 for u in got)
    assert holdings(replay(got)) == holdings(index)


def test_long_changes_and_snapshots_are_chunked(loop) -> None:
    hashes = make_chain("big", CHUNK_HASHES * 2 + 5)
    index = make_index({"a": hashes}, max_pending=10 * CHUNK_HASHES)
    follower = Follower(index.subscribe())
    index.add_node("b")
    index.add_blocks("b", hashes)
    got = follower.take()
    sizes = [(u.kind, len(u.block_hashes) // 32) for u in got]
    full, tail = (CHUNK_HASHES, 5)
    assert sizes == [(U.SNAPSHOT, full), (U.SNAPSHOT, full), (U.SNAPSHOT, tail),
                     (U.SNAPSHOT_COMPLETE, 0), (U.STORED, full), (U.STORED, full), (U.STORED, tail)]


def test_without_subscribers_nothing_is_built(loop) -> None:
    index = make_index({"a": CHAIN})
    subscriber = index.subscribe()
    index.unsubscribe(subscriber)
    index.add_blocks("a", make_chain("more", 3))
    assert not subscriber._queue and index.subscribers == []


def test_slow_subscriber_is_cut_off_alone(loop) -> None:
    index = make_index({"a": CHAIN[:2]}, max_pending=10)
    slow, fast = index.subscribe(), index.subscribe()
    slow_reader, fast_reader = Follower(slow), Follower(fast)
    slow_reader.take(2), fast_reader.take()  # the slow one stops after the snapshot
    index.add_blocks("a", CHAIN[2:8])   # 6 pending for each
    fast_reader.take()
    index.add_blocks("a", CHAIN[8:12])  # slow: 6 + 4 = 10, still within the bound
    index.clear_node("a")               # slow: 11 > 10 -> cut off
    assert slow.cut and index.subscribers == [fast] and index.num_cut == 1
    with pytest.raises(SubscriberTooSlow, match="more than 10 hashes behind"):
        slow_reader.take()
    fast_reader.take()
    assert [u.kind for u in fast_reader.got[2:]] == [U.STORED, U.STORED, U.CLEARED]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "remove", "clear", "drop", "replace"]),
                          st.sampled_from(["a", "b", "c"]),
                          st.lists(st.integers(0, 11), max_size=6)), max_size=30),
       st.integers(0, 30))
def test_replay_equals_the_index_even_when_changes_race_the_snapshot(ops, cut) -> None:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        index = make_index({"a": CHAIN[:6], "b": CHAIN[3:9], "c": []}, max_pending=10**6)
        follower = Follower(index.subscribe())
        got = follower.take(1)  # the first snapshot chunk only: the rest comes later
        for i, (op, node_id, picks) in enumerate(ops):
            if i == cut:
                got += follower.take(2)
            hashes = [CHAIN[p] for p in picks]
            if not index.has_node(node_id):
                index.add_node(node_id)
            if op == "add":
                index.add_blocks(node_id, hashes)
            elif op == "remove":
                index.remove_blocks(node_id, hashes)
            elif op == "clear":
                index.clear_node(node_id)
            elif op == "drop":
                index.remove_node(node_id)
            else:
                index.replace_node_blocks(node_id, hashes)
        got += follower.take()
        assert U.SNAPSHOT_COMPLETE in [u.kind for u in got]
        assert holdings(replay(got)) == holdings(index)
    finally:
        _close(loop)


def _stub(server: ServerThread) -> tuple[grpc.Channel, pb_grpc.MetadataServiceStub]:
    channel = grpc.insecure_channel(server.address)
    return channel, pb_grpc.MetadataServiceStub(channel)


def test_watch_blocks_needs_the_token() -> None:
    with ServerThread(make_config(cluster_secret=TEST_SECRET)) as server:
        channel, stub = _stub(server)
        with channel, pytest.raises(grpc.RpcError) as info:
            next(iter(stub.WatchBlocks(pb.WatchBlocksRequest())))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        channel, stub = _stub(server)
        with channel:
            stream = stub.WatchBlocks(pb.WatchBlocksRequest(),
                                      metadata=(("authorization", f"Bearer {SERVICE_TOKEN}"),))
            assert next(iter(stream)).kind == U.SNAPSHOT_COMPLETE
            stream.cancel()


def test_a_reader_that_stops_reading_is_cut_off_over_grpc() -> None:
    with ServerThread(make_config(watch_max_pending_hashes=4096)) as server, \
            MetadataClient(server.address) as client:
        publisher, node = make_publisher(client, ttl=30)
        publisher.publish([node.store(CHAIN)])
        channel, stub = _stub(server)
        with channel:
            stream = stub.WatchBlocks(pb.WatchBlocksRequest())
            first = [next(stream), next(stream)]
            assert [u.kind for u in first] == [U.SNAPSHOT, U.SNAPSHOT_COMPLETE]
            assert client.stats().block_watchers == 1
            # a stalled reader: the socket and HTTP/2 windows fill, then the queue's bound
            for i in range(150):
                publisher.publish([node.store(make_chain(f"flood{i}", 2048))])
                if client.stats().block_watchers_cut:
                    break
            with pytest.raises(grpc.RpcError) as info:
                for _ in stream:
                    pass
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        stats = client.stats()
        assert stats.block_watchers_cut == 1 and stats.block_watchers == 0


def test_a_replica_streams_what_it_learns_from_etcd(etcd) -> None:
    """The router follows replica b while the nodes publish to replica a: b's index changes
    through etcd's watch (remote deltas, bases), and b streams those changes too."""
    from pdcluster.router.routing.metadata_link import MetadataLink
    from tests.metadata_service.helpers import wait_until

    def config(replica: str):
        return make_config(backend="etcd", etcd_endpoints=(etcd.endpoint,), replica_id=replica)

    async def scenario(b: ServerThread, client_a: MetadataClient,
                       client_b: MetadataClient) -> None:
        link = MetadataLink(b.address)
        p0, node = make_publisher(client_a, "p0", ttl=30)
        p0.publish([node.store(CHAIN[:8])])
        for step in ([node.evict(CHAIN[5:6])], [node.store(make_chain("x", 3))]):
            p0.publish(step)
            await asyncio.to_thread(wait_until, lambda: client_b.query(CHAIN) ==
                                    client_a.query(CHAIN), what="replica b to catch up")
            for _ in range(100):
                if link.mirror_in_sync and await link.prefix_hits(CHAIN) == dict(
                        client_b.query(CHAIN)):
                    break
                await asyncio.sleep(0.05)
            assert await link.prefix_hits(CHAIN) == dict(client_a.query(CHAIN))
        assert await link.prefix_hits(CHAIN) == {"p0": 5}
        await link.close()

    with ServerThread(config("a")) as a, ServerThread(config("b")) as b, \
            MetadataClient(a.address) as client_a, MetadataClient(b.address) as client_b:
        asyncio.run(scenario(b, client_a, client_b))
