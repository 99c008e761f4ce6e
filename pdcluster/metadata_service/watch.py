"""The service's watch streams: ``WatchBlocks`` (the index's changes, for the router's mirror)
and ``WatchNodes`` (registry changes).

``WatchedIndex`` is the service's ``BlockIndex``: each public mutator applies its change, then,
only if someone subscribed, queues one ``pb.BlockUpdate`` per change (long ones chunked) for
every subscriber, in the order the index applied them. One event loop owns the index, so that
order is the service's. With no subscriber a mutation costs one truth test.

A subscriber's stream: a snapshot of every node's block set (with the media of the blocks not
on the device alone), SNAPSHOT_COMPLETE, then the queued changes; a change names the medium
it concerns (STORED, REMOVED) or both ends (MOVED), as the node's event did. Changes are
queued from the moment of subscription; each node's snapshot is copied when its turn comes
(one node at a time, not the whole index in one go on the loop), so a chunk may already
reflect a change queued behind it. That is harmless: every change is an idempotent set
operation, and replaying them in order ends at the service's state.

Back-pressure: a subscriber's queue holds at most ``max_pending`` hashes (a clear or a node
removal counts 1). Going over cuts it off at once: the queue is dropped, it leaves the
fan-out and its stream ends with ``SubscriberTooSlow`` (RESOURCE_EXHAUSTED on the wire); it
resubscribes for a fresh snapshot. The service never waits for a subscriber.

API: ``WatchedIndex``, ``BlockSubscriber``, ``SubscriberTooSlow``, ``NodeWatch``,
``CHUNK_HASHES``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Collection, Iterable, Iterator, Mapping

from pdcluster.core.block_index import MEDIUM_BITS, BlockIndex
from pdcluster.core.events import DEVICE
from pdcluster.core.types import BlockHash, NodeId
from pdcluster.metadata_service.events import medium_to_pb
from pdcluster.proto import metadata_pb2 as pb

logger = logging.getLogger(__name__)

CHUNK_HASHES = 16384  # per message: 512 KiB of 32-byte hashes
_Update = pb.BlockUpdate
_DEVICE_BIT = MEDIUM_BITS[DEVICE]


class SubscriberTooSlow(Exception):
    """The subscriber fell more than its bound behind and was cut off."""


class BlockSubscriber:
    """One WatchBlocks stream: the snapshot, then the changes queued for it."""

    __slots__ = ("_index", "_nodes", "_queue", "_pending", "_max_pending", "_wakeup", "cut")

    def __init__(self, index: WatchedIndex, max_pending: int) -> None:
        self._index = index
        self._nodes = index.node_ids  # the snapshot covers these; later nodes come as changes
        self._queue: deque[tuple[pb.BlockUpdate, int]] = deque()
        self._pending = 0
        self._max_pending = max_pending
        self._wakeup = asyncio.Event()
        self.cut = False

    def push(self, update: pb.BlockUpdate, weight: int) -> bool:
        """Queue one change; False (and the subscriber is cut off) when over the bound."""
        if self._pending + weight > self._max_pending:
            self.cut = True
            self._queue.clear()
            self._pending = 0
            self._wakeup.set()
            return False
        self._queue.append((update, weight))
        self._pending += weight
        self._wakeup.set()
        return True

    async def updates(self) -> AsyncIterator[pb.BlockUpdate]:
        """The stream's messages; raises ``SubscriberTooSlow`` once cut off."""
        for update in self._index.snapshot_updates(self._nodes):
            yield update
            self._check()
        yield _Update(kind=_Update.SNAPSHOT_COMPLETE, hash_size=self._index.hash_size)
        queue = self._queue
        while True:
            self._check()
            if not queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            update, weight = queue.popleft()
            self._pending -= weight
            yield update

    def _check(self) -> None:
        if self.cut:
            raise SubscriberTooSlow(
                f"more than {self._max_pending} hashes behind: subscribe again")


class WatchedIndex(BlockIndex):
    """A ``BlockIndex`` whose changes are streamed to subscribers (see the module docstring).
    Block arguments must be collections (iterated twice when someone watches)."""

    __slots__ = ("hash_size", "max_pending", "subscribers", "num_cut")

    def __init__(self, hash_size: int, max_pending: int) -> None:
        super().__init__()
        self.hash_size = hash_size
        self.max_pending = max_pending
        self.subscribers: list[BlockSubscriber] = []
        self.num_cut = 0

    def subscribe(self) -> BlockSubscriber:
        subscriber = BlockSubscriber(self, self.max_pending)
        self.subscribers.append(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: BlockSubscriber) -> None:
        if subscriber in self.subscribers:
            self.subscribers.remove(subscriber)

    def snapshot_updates(self, node_ids: list[NodeId]) -> Iterator[pb.BlockUpdate]:
        """SNAPSHOT chunks of these nodes' current sets, each set copied on its turn."""
        for node_id in node_ids:
            if self.has_node(node_id):
                hashes = list(self._node_blocks[node_id])
                media = self._media[node_id]
                masks = bytes(media.get(h, _DEVICE_BIT) for h in hashes) if media else b""
                yield from self._chunks(_Update.SNAPSHOT, node_id, hashes, masks=masks)

    # -- the observed mutators -------------------------------------------------------------

    def remove_node(self, node_id: NodeId) -> int:
        watched = bool(self.subscribers) and self.has_node(node_id)
        num_removed = super().remove_node(node_id)
        if watched:
            self._emit(_Update.NODE_REMOVED, node_id)
        return num_removed

    def add_blocks(self, node_id: NodeId, block_hashes: Iterable[BlockHash],
                   medium: str = DEVICE) -> int:
        hashes = _collection(block_hashes)
        num_new = super().add_blocks(node_id, hashes, medium)
        if self.subscribers and hashes:
            self._emit(_Update.STORED, node_id, hashes, None if medium == DEVICE else medium)
        return num_new

    def remove_blocks(self, node_id: NodeId, block_hashes: Iterable[BlockHash],
                      medium: str | None = None) -> int:
        hashes = _collection(block_hashes)
        num_removed = super().remove_blocks(node_id, hashes, medium)
        if self.subscribers and hashes:
            self._emit(_Update.REMOVED, node_id, hashes, medium)
        return num_removed

    def move_blocks(self, node_id: NodeId, block_hashes: Iterable[BlockHash], src: str,
                    dst: str) -> int:
        hashes = _collection(block_hashes)
        num_new = super().move_blocks(node_id, hashes, src, dst)
        if self.subscribers and hashes:
            self._emit(_Update.MOVED, node_id, hashes, dst, src)
        return num_new

    def clear_node(self, node_id: NodeId) -> int:
        num_removed = super().clear_node(node_id)
        if self.subscribers:
            self._emit(_Update.CLEARED, node_id)
        return num_removed

    def replace_node_blocks(
        self, node_id: NodeId, block_hashes: Iterable[BlockHash],
        media: Mapping[BlockHash, int] | None = None,
    ) -> tuple[set[BlockHash], set[BlockHash]]:
        old_media = dict(self._media[node_id]) if self.subscribers else {}
        removed, added = super().replace_node_blocks(node_id, block_hashes, media)
        if self.subscribers:
            if removed:
                self._emit(_Update.REMOVED, node_id, removed)
            self._emit_media_diff(node_id, added, old_media, self._media[node_id])
        return removed, added

    def _emit_media_diff(self, node_id: NodeId, added: set[BlockHash],
                         old: Mapping[BlockHash, int], new: Mapping[BlockHash, int]) -> None:
        """STORED per medium a block gained (new blocks on the device unless `new` says
        otherwise), then REMOVED per medium it lost: a held block never blinks out."""
        held = self._node_blocks[node_id]
        gained: dict[str, list[BlockHash]] = {}
        lost: dict[str, list[BlockHash]] = {}
        for block_hash in set(old) | set(new) | added:
            if block_hash not in held:
                continue
            before = 0 if block_hash in added else old.get(block_hash, _DEVICE_BIT)
            after = new.get(block_hash, _DEVICE_BIT)
            for medium, bit in MEDIUM_BITS.items():
                if after & bit and not before & bit:
                    gained.setdefault(medium, []).append(block_hash)
                elif before & bit and not after & bit:
                    lost.setdefault(medium, []).append(block_hash)
        for medium, hashes in gained.items():
            self._emit(_Update.STORED, node_id, hashes, None if medium == DEVICE else medium)
        for medium, hashes in lost.items():
            self._emit(_Update.REMOVED, node_id, hashes, medium)

    # -- fan-out ---------------------------------------------------------------------------

    def _emit(self, kind: pb.BlockUpdate.Kind, node_id: NodeId,
              block_hashes: Collection[BlockHash] = (), medium: str | None = None,
              src: str | None = None) -> None:
        hashes = block_hashes if isinstance(block_hashes, list) else list(block_hashes)
        for update in self._chunks(kind, node_id, hashes, medium, src):
            weight = max(1, len(update.block_hashes) // self.hash_size)
            for subscriber in [s for s in self.subscribers if not s.push(update, weight)]:
                self.subscribers.remove(subscriber)
                self.num_cut += 1
                logger.warning("a WatchBlocks subscriber fell more than %d hashes behind: "
                               "cut off (it resubscribes for a snapshot)", self.max_pending)

    def _chunks(self, kind: pb.BlockUpdate.Kind, node_id: NodeId, hashes: list[BlockHash],
                medium: str | None = None, src: str | None = None, masks: bytes = b""
                ) -> Iterator[pb.BlockUpdate]:
        tier, src_tier = medium_to_pb(medium), medium_to_pb(src)
        if not hashes:
            yield _Update(kind=kind, node_id=node_id, hash_size=self.hash_size, medium=tier,
                          src_medium=src_tier)
            return
        for start in range(0, len(hashes), CHUNK_HASHES):
            end = start + CHUNK_HASHES
            yield _Update(kind=kind, node_id=node_id, hash_size=self.hash_size,
                          block_hashes=b"".join(hashes[start:end]), media=masks[start:end],
                          medium=tier, src_medium=src_tier)


class NodeWatch:
    """WatchNodes' fan-out: one unbounded queue per stream (registry changes are rare)."""

    def __init__(self) -> None:
        self._queues: list[asyncio.Queue[pb.NodeChange]] = []

    def subscribe(self, live: list[pb.NodeInfo]) -> asyncio.Queue[pb.NodeChange]:
        """A queue that gets every node of ``live`` as UP, then each change."""
        queue: asyncio.Queue[pb.NodeChange] = asyncio.Queue()
        for info in live:
            queue.put_nowait(pb.NodeChange(kind=pb.NodeChange.UP, node=info))
        self._queues.append(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[pb.NodeChange]) -> None:
        self._queues.remove(queue)

    def notify(self, kind: pb.NodeChange.Kind, info: pb.NodeInfo) -> None:
        for queue in self._queues:
            queue.put_nowait(pb.NodeChange(kind=kind, node=info))


def _collection(block_hashes: Iterable[BlockHash]) -> Collection[BlockHash]:
    """The hashes as a collection: the index and then the watchers both read them."""
    return block_hashes if isinstance(block_hashes, Collection) else list(block_hashes)
