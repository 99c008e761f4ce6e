"""KV tiers in the global index: events name the medium, the service's index keeps each node's
media per block (a move is one event, the block never leaves in between), queries say how many
leading blocks sit below the device, snapshots carry media, and the router's mirror — fed by
the real WatchBlocks stream, or asking `Query` while out of sync — agrees with the service."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.core.block_index import BlockIndex, apply_events
from pdcluster.core.events import DEVICE, DISK, HOST, BlockMoved, BlockRemoved, BlockStored
from pdcluster.metadata_service.client import MetadataClient
from pdcluster.metadata_service.errors import InvalidBatch
from pdcluster.metadata_service.events import Op, decode_events, encode_events
from pdcluster.metadata_service.server import ServerThread
from pdcluster.proto import metadata_pb2 as pb
from pdcluster.router.routing.metadata_link import MetadataLink, PrefixHits, _apply
from tests.metadata_service.helpers import make_chain, make_config, make_publisher, wait_until
from tests.metadata_service.test_service import make_service, register
from tests.metadata_service.test_watch import Follower, _close, make_index

CHAIN = make_chain("tiers", 8)


def state(index: BlockIndex) -> dict[str, dict[bytes, int]]:
    """Every node's blocks with their media masks."""
    return {n: {h: index.node_media(n).get(h, 1) for h in index.node_blocks(n)}
            for n in index.node_ids if index.num_node_blocks(n)}


def test_events_round_trip_with_their_media() -> None:
    events = [BlockStored(tuple(CHAIN[:2]), None, 16), BlockStored((CHAIN[2],), CHAIN[1], 16, HOST),
              BlockMoved((CHAIN[0],), DEVICE, HOST), BlockRemoved((CHAIN[1],), DEVICE),
              BlockRemoved((CHAIN[2],))]
    changes = decode_events(encode_events(events), make_config())
    assert [(c.op, c.medium, c.src) for c in changes] == [
        (Op.STORED, DEVICE, None), (Op.STORED, HOST, None), (Op.MOVED, HOST, DEVICE),
        (Op.REMOVED, DEVICE, None), (Op.REMOVED, None, None)]


def test_an_unknown_medium_is_refused_by_name() -> None:
    msg = pb.KVEventMsg(moved=pb.BlockMovedEvent(block_hashes=CHAIN[0], src=pb.MEDIUM_DEVICE,
                                                 dst=17))
    with pytest.raises(InvalidBatch, match="unknown medium 17"):
        decode_events([msg], make_config())
    half = pb.KVEventMsg(moved=pb.BlockMovedEvent(block_hashes=CHAIN[0], src=pb.MEDIUM_DEVICE))
    with pytest.raises(InvalidBatch, match="a move needs both media"):
        decode_events([half], make_config())


def test_a_demotion_is_one_event_and_queries_count_the_lower_tiers() -> None:
    service, store, _ = make_service()
    register(service)
    events = [BlockStored(tuple(CHAIN[:6]), None, 16)]
    service.publish("p0", 7, 1, encode_events(events))
    store.calls.clear()
    service.publish("p0", 7, 2, encode_events([BlockMoved(tuple(CHAIN[3:6]), DEVICE, HOST)]))
    assert service.query_tiers(b"".join(CHAIN)) == [("p0", 6, 3, 0)]
    assert service.query(b"".join(CHAIN)) == [("p0", 6)]
    # dropping the host copy of a block also on the device keeps it; the store (membership
    # only) hears of a removal only for a block left with no copy
    service.publish("p0", 7, 3, encode_events([BlockStored((CHAIN[3],), CHAIN[2], 16),
                                               BlockRemoved((CHAIN[3], CHAIN[5]), HOST)]))
    assert service.query_tiers(b"".join(CHAIN)) == [("p0", 5, 1, 0)]
    assert ("removed", "p0", 1) in store.calls
    service.index.check_invariants()


def test_a_snapshot_with_media_replaces_the_node_exactly() -> None:
    service, _, _ = make_service()
    register(service)
    service.publish("p0", 7, 1, encode_events([BlockStored(tuple(CHAIN[:4]), None, 16)]))
    media = bytes([1, 3, 2, 4])
    service.snapshot("p0", 7, 5, b"".join(CHAIN[2:6]), media)
    assert state(service.index) == {"p0": dict(zip(CHAIN[2:6], media, strict=True))}
    # masks 1, 3 (device and host), 2 (host), 4 (disk): one block to load from each
    assert service.query_tiers(b"".join(CHAIN[2:])) == [("p0", 4, 1, 1)]
    with pytest.raises(InvalidBatch, match="2 media masks"):
        service.snapshot("p0", 7, 6, b"".join(CHAIN[:3]), bytes([1, 2]))
    with pytest.raises(InvalidBatch, match="names no medium"):
        service.snapshot("p0", 7, 6, b"".join(CHAIN[:1]), bytes([0]))


OPS = st.sampled_from(["store", "store_host", "move_down", "move_up", "drop_device",
                       "drop_host", "drop", "clear", "replace"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(OPS, st.sampled_from(["a", "b"]),
                          st.lists(st.integers(0, 7), max_size=5)), max_size=25),
       st.integers(0, 25))
def test_the_routers_mirror_follows_every_medium(ops, cut) -> None:
    """The stream, applied by the router's own code, ends at the service's index, media
    included, however the changes race the snapshot."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        index = make_index({"a": CHAIN[:5], "b": []}, max_pending=10**6)
        index.move_blocks("a", CHAIN[3:5], DEVICE, HOST)
        follower = Follower(index.subscribe())
        got = follower.take(1)
        for i, (op, node_id, picks) in enumerate(ops):
            if i == cut:
                got += follower.take(2)
            _mutate(index, op, node_id, [CHAIN[p] for p in picks])
        got += follower.take()
        mirror = BlockIndex()
        for update in got:
            if update.kind != pb.BlockUpdate.SNAPSHOT_COMPLETE:
                assert _apply(mirror, update)
        mirror.check_invariants()
        assert state(mirror) == state(index)
    finally:
        _close(loop)


def _mutate(index, op: str, node_id: str, hashes: list[bytes]) -> None:
    if op == "store":
        index.add_blocks(node_id, hashes)
    elif op == "store_host":
        index.add_blocks(node_id, hashes, HOST)
    elif op == "move_down":
        index.move_blocks(node_id, hashes, DEVICE, HOST)
    elif op == "move_up":
        index.move_blocks(node_id, hashes, HOST, DEVICE)
    elif op == "drop_device":
        index.remove_blocks(node_id, hashes, DEVICE)
    elif op == "drop_host":
        index.remove_blocks(node_id, hashes, HOST)
    elif op == "drop":
        index.remove_blocks(node_id, hashes)
    elif op == "clear":
        index.clear_node(node_id)
    else:
        index.replace_node_blocks(node_id, hashes, {h: 6 for h in hashes[:1]})


def test_a_node_to_the_router_over_grpc() -> None:
    """A node publishes a demotion and resyncs with media; the router's mirror, and its
    per-request Query path, both say how many leading blocks each node must load."""

    async def scenario(server: ServerThread, client: MetadataClient) -> None:
        publisher, _ = make_publisher(client, "p0", ttl=30)
        publisher.publish([BlockStored(tuple(CHAIN[:6]), None, 16)])
        publisher.publish([BlockMoved(tuple(CHAIN[4:6]), DEVICE, HOST)])
        mirror, per_request = MetadataLink(server.address), MetadataLink(server.address,
                                                                          mirror=False)
        expected = PrefixHits({"p0": 6}, {"p0": (2, 0)})
        for link in (mirror, per_request):
            await asyncio.to_thread(wait_until, lambda lk=link: lk is per_request
                                    or lk.mirror_in_sync, what="the mirror")
            hits = await link.prefix_hits(CHAIN)
            assert hits == expected and hits.lower == expected.lower
        publisher.snapshot_fn = lambda: dict(zip(CHAIN[:6], [1, 1, 1, 2, 4, 2], strict=True))
        publisher.resync()
        for _ in range(100):
            if (await mirror.prefix_hits(CHAIN)).lower == {"p0": (2, 1)}:
                break
            await asyncio.sleep(0.05)
        for link in (mirror, per_request):
            assert (await link.prefix_hits(CHAIN)).lower == {"p0": (2, 1)}
            await link.close()

    with ServerThread(make_config()) as server, MetadataClient(server.address) as client:
        asyncio.run(scenario(server, client))


def test_apply_events_matches_the_service_for_a_disk_copy() -> None:
    index = BlockIndex()
    index.add_node("n")
    apply_events(index, "n", [BlockStored((CHAIN[0],), None, 16, DISK),
                              BlockMoved((CHAIN[0],), DISK, HOST)])
    assert index.lower_tiers("n", CHAIN[:1]) == (1, 0)
    assert index.node_media("n") == {CHAIN[0]: 2}
