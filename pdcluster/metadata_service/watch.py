"""The service's watch streams: ``WatchBlocks`` (the index's changes, for the router's mirror)
and ``WatchNodes`` (registry changes).

``WatchedIndex`` is the service's ``BlockIndex``: each public mutator applies its change, then,
only if someone subscribed, queues one ``pb.BlockUpdate`` per change (long ones chunked) for
every subscriber, in the order the index applied them. One event loop owns the index, so that
order is the service's. With no subscriber a mutation costs one truth test.

A subscriber's stream: a snapshot of every node's block set, SNAPSHOT_COMPLETE, then the
queued changes. Changes are queued from the moment of subscription; each node's snapshot is
copied when its turn comes (one node at a time, not the whole index in one go on the loop), so
a chunk may already reflect a change queued behind it. That is harmless: every change is an
idempotent set operation, and replaying them in order ends at the service's state.

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
from collections.abc import AsyncIterator, Collection, Iterable, Iterator

from pdcluster.core.block_index import BlockIndex
from pdcluster.core.types import BlockHash, NodeId
from pdcluster.proto import metadata_pb2 as pb

logger = logging.getLogger(__name__)

CHUNK_HASHES = 16384  # per message: 512 KiB of 32-byte hashes
_Update = pb.BlockUpdate


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
                yield from self._chunks(_Update.SNAPSHOT, node_id, hashes)

    # -- the observed mutators -------------------------------------------------------------

    def remove_node(self, node_id: NodeId) -> int:
        watched = bool(self.subscribers) and self.has_node(node_id)
        num_removed = super().remove_node(node_id)
        if watched:
            self._emit(_Update.NODE_REMOVED, node_id)
        return num_removed

    def add_blocks(self, node_id: NodeId, block_hashes: Iterable[BlockHash]) -> int:
        hashes = _collection(block_hashes)
        num_new = super().add_blocks(node_id, hashes)
        if self.subscribers and hashes:
            self._emit(_Update.STORED, node_id, hashes)
        return num_new

    def remove_blocks(self, node_id: NodeId, block_hashes: Iterable[BlockHash]) -> int:
        hashes = _collection(block_hashes)
        num_removed = super().remove_blocks(node_id, hashes)
        if self.subscribers and hashes:
            self._emit(_Update.REMOVED, node_id, hashes)
        return num_removed

    def clear_node(self, node_id: NodeId) -> int:
        num_removed = super().clear_node(node_id)
        if self.subscribers:
            self._emit(_Update.CLEARED, node_id)
        return num_removed

    def replace_node_blocks(
        self, node_id: NodeId, block_hashes: Iterable[BlockHash]
    ) -> tuple[set[BlockHash], set[BlockHash]]:
        removed, added = super().replace_node_blocks(node_id, block_hashes)
        if self.subscribers:
            if removed:
                self._emit(_Update.REMOVED, node_id, removed)
            if added:
                self._emit(_Update.STORED, node_id, added)
        return removed, added

    # -- fan-out ---------------------------------------------------------------------------

    def _emit(self, kind: pb.BlockUpdate.Kind, node_id: NodeId,
              block_hashes: Collection[BlockHash] = ()) -> None:
        hashes = block_hashes if isinstance(block_hashes, list) else list(block_hashes)
        for update in self._chunks(kind, node_id, hashes):
            weight = max(1, len(update.block_hashes) // self.hash_size)
            for subscriber in [s for s in self.subscribers if not s.push(update, weight)]:
                self.subscribers.remove(subscriber)
                self.num_cut += 1
                logger.warning("a WatchBlocks subscriber fell more than %d hashes behind: "
                               "cut off (it resubscribes for a snapshot)", self.max_pending)

    def _chunks(self, kind: pb.BlockUpdate.Kind, node_id: NodeId, hashes: list[BlockHash]
                ) -> Iterator[pb.BlockUpdate]:
        if not hashes:
            yield _Update(kind=kind, node_id=node_id, hash_size=self.hash_size)
            return
        for start in range(0, len(hashes), CHUNK_HASHES):
            yield _Update(kind=kind, node_id=node_id, hash_size=self.hash_size,
                          block_hashes=b"".join(hashes[start:start + CHUNK_HASHES]))


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
