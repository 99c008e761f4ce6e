"""MetadataService logic without gRPC: sequencing, resync, validation, leases (injected clock),
and what it hands to the store (a fake that subclasses the real interface)."""

from __future__ import annotations

import asyncio

import pytest

from pdcluster.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from pdcluster.metadata_service.client import make_node_info
from pdcluster.metadata_service.errors import InvalidBatch
from pdcluster.metadata_service.events import encode_events
from pdcluster.metadata_service.service import MetadataService, PublishStatus
from pdcluster.metadata_service.store import IndexStore
from pdcluster.proto import metadata_pb2 as pb
from tests.metadata_service.helpers import make_chain, make_config

CHAIN = make_chain("svc", 6)


class RecordingStore(IndexStore):
    """Records every persistence call; persists nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def node_up(self, info, lease_ttl_s, restarted, proof_hash=b""):
        self.calls.append(("up", info.node_id, restarted))

    def node_down(self, node_id):
        self.calls.append(("down", node_id))

    def blocks_stored(self, node_id, block_hashes):
        self.calls.append(("stored", node_id, len(list(block_hashes))))

    def blocks_removed(self, node_id, block_hashes):
        self.calls.append(("removed", node_id, len(list(block_hashes))))

    def blocks_cleared(self, node_id):
        self.calls.append(("cleared", node_id))

    def position(self, node_id, epoch, seq):
        self.calls.append(("position", node_id, seq))


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_service(**overrides) -> tuple[MetadataService, RecordingStore, FakeClock]:
    store, clock = RecordingStore(), FakeClock()
    return MetadataService(make_config(**overrides), store, clock=clock), store, clock


def register(service, node_id="p0", role="prefill", epoch=7, ttl=2):
    return service.register(make_node_info(node_id, role, epoch=epoch), ttl)


def stored(hashes, parent=None):
    return encode_events([BlockStored(tuple(hashes), parent, 16)])


def test_in_order_batches_apply_and_reach_the_store() -> None:
    service, store, _ = make_service()
    assert register(service) == (2, 0)
    assert service.publish("p0", 7, 1, stored(CHAIN[:4])) == (PublishStatus.OK, 1)
    assert service.publish("p0", 7, 2, encode_events([BlockRemoved((CHAIN[3],))])) == (
        PublishStatus.OK, 2)
    assert service.query(b"".join(CHAIN)) == [("p0", 3)]
    assert store.calls == [("up", "p0", False), ("stored", "p0", 4), ("position", "p0", 1),
                           ("removed", "p0", 1), ("position", "p0", 2)]
    assert service.stats().events_ingested == 5


def test_duplicate_is_ignored_and_gap_asks_for_resync() -> None:
    service, _, _ = make_service()
    register(service)
    service.publish("p0", 7, 1, stored(CHAIN[:2]))
    assert service.publish("p0", 7, 1, stored(CHAIN[:6])) == (PublishStatus.DUPLICATE, 1)
    assert service.publish("p0", 7, 3, stored(CHAIN[:6])) == (PublishStatus.RESYNC_NEEDED, 1)
    assert service.query(b"".join(CHAIN)) == [("p0", 2)], "neither batch may apply"
    assert service.snapshot("p0", 7, 3, b"".join(CHAIN[:5])) == 3
    assert service.query(b"".join(CHAIN)) == [("p0", 5)]
    assert service.publish("p0", 7, 4, encode_events([AllBlocksCleared()]))[0] == PublishStatus.OK
    assert service.query(b"".join(CHAIN)) == []
    stats = service.stats()
    assert (stats.resyncs_requested, stats.snapshots_applied) == (1, 1)


def test_wrong_epoch_asks_for_resync_and_restart_drops_blocks() -> None:
    service, store, _ = make_service()
    register(service)
    service.publish("p0", 7, 1, stored(CHAIN[:2]))
    assert service.publish("p0", 8, 2, stored(CHAIN[:3]))[0] == PublishStatus.RESYNC_NEEDED
    assert register(service, epoch=8) == (2, 0)
    assert service.query(b"".join(CHAIN)) == []
    assert ("up", "p0", True) in store.calls


def test_unknown_node() -> None:
    service, _, _ = make_service()
    assert service.publish("ghost", 1, 1, stored(CHAIN[:1]))[0] == PublishStatus.UNKNOWN_NODE
    with pytest.raises(InvalidBatch, match="not registered"):
        service.snapshot("ghost", 1, 1, b"")


@pytest.mark.parametrize(("events", "reason", "message"), [
    ([pb.KVEventMsg(stored=pb.BlockStoredEvent(block_hashes=b"x" * 33))], "bad_hash_length",
     "event 0 block_hashes has 33 bytes, not a multiple of the 32-byte hash size"),
    ([pb.KVEventMsg(stored=pb.BlockStoredEvent(block_hashes=b""))], "empty_event",
     "event 0: a stored event with no hashes"),
    ([pb.KVEventMsg(stored=pb.BlockStoredEvent(block_hashes=b"x" * 32, parent_hash=b"p"))],
     "bad_parent_hash", "event 0: parent_hash has 1 bytes, expected 0 or 32"),
    ([pb.KVEventMsg()], "missing_event_kind", "event 0: no event kind set"),
    ([pb.KVEventMsg(cleared=pb.AllBlocksClearedEvent())] * 5, "too_many_events",
     "batch has 5 events, more than max_batch_events=4"),
    ([pb.KVEventMsg(removed=pb.BlockRemovedEvent(block_hashes=b"y" * 32 * 9))],
     "too_many_hashes", "batch has more than max_batch_hashes=8 hashes"),
])
def test_malformed_batches_are_rejected_and_counted(events, reason, message) -> None:
    service, _, _ = make_service(max_batch_events=4, max_batch_hashes=8)
    register(service)
    with pytest.raises(InvalidBatch) as info:
        service.publish("p0", 7, 1, events)
    assert (info.value.reason, str(info.value)) == (reason, message)
    stats = service.stats()
    assert stats.batches_rejected == 1 and dict(stats.rejected_by_reason) == {reason: 1}


def test_a_rejected_batch_applies_nothing_and_forces_a_resync() -> None:
    service, _, _ = make_service()
    register(service)
    good = stored(CHAIN[:1])
    bad = [pb.KVEventMsg(removed=pb.BlockRemovedEvent(block_hashes=b"z"))]
    with pytest.raises(InvalidBatch, match="event 1 block_hashes has 1 bytes"):
        service.publish("p0", 7, 1, [*good, *bad])
    assert service.query(b"".join(CHAIN)) == [], "nothing of a rejected batch applies"
    # The rejected seq was not consumed: the node's next batch is a gap -> resync.
    assert service.publish("p0", 7, 2, good)[0] == PublishStatus.RESYNC_NEEDED


def test_bad_registrations_and_queries_are_rejected() -> None:
    service, _, _ = make_service(max_query_blocks=4)
    with pytest.raises(InvalidBatch, match="node_id 'a/b' must match"):
        register(service, node_id="a/b")
    with pytest.raises(InvalidBatch, match="role must be PREFILL or DECODE"):
        service.register(pb.NodeInfo(node_id="x"), 2)
    with pytest.raises(InvalidBatch, match="max_query_blocks=4"):
        service.query(b"".join(CHAIN))
    with pytest.raises(InvalidBatch, match="not a multiple"):
        service.query(b"abc")
    assert dict(service.stats().rejected_by_reason) == {
        "bad_node_id": 1, "bad_role": 1, "query_too_long": 1, "bad_hash_length": 1}


def test_role_and_node_filters() -> None:
    service, _, _ = make_service()
    register(service, "p0", "prefill")
    register(service, "d0", "decode")
    for node_id in ("p0", "d0"):
        service.publish(node_id, 7, 1, stored(CHAIN[:3]))
    packed = b"".join(CHAIN)
    assert service.query(packed) == [("d0", 3), ("p0", 3)]
    assert service.query(packed, role=pb.DECODE) == [("d0", 3)]
    assert service.query(packed, node_ids=["p0", "ghost"]) == [("p0", 3)]
    assert service.query(packed, role=pb.DECODE, node_ids=["p0"]) == []
    assert [n.node_id for n in service.list_nodes(pb.PREFILL)] == ["p0"]


def test_lease_expiry_removes_node_and_blocks() -> None:
    service, store, clock = make_service()
    register(service, ttl=2)
    service.publish("p0", 7, 1, stored(CHAIN[:3]))
    clock.now += 1.5
    assert service.heartbeat("p0", 7)
    clock.now += 1.9
    assert service.expire_leases() == []
    clock.now += 0.2
    assert service.expire_leases() == ["p0"]
    assert service.query(b"".join(CHAIN)) == [] and service.index.num_blocks == 0
    assert not service.heartbeat("p0", 7)
    assert store.calls[-1] == ("down", "p0")


def test_watchers_see_up_and_down() -> None:
    async def scenario() -> list[tuple[int, str]]:
        service, _, _ = make_service()
        register(service, "p0")
        queue = service.node_watch.subscribe(service.list_nodes())
        register(service, "d0", "decode")
        service.deregister("p0")
        return [(c.kind, c.node.node_id) for c in
                [queue.get_nowait() for _ in range(queue.qsize())]]

    up, down = pb.NodeChange.UP, pb.NodeChange.DOWN
    assert asyncio.run(scenario()) == [(up, "p0"), (up, "d0"), (down, "p0")]
