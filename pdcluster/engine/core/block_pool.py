"""The KV block pool and its prefix cache (torch-free bookkeeping; the bytes live elsewhere).

Every KV block is either in use (``ref_cnt > 0``, held by one or more requests) or free. Free
blocks sit in an LRU queue, least recently freed first; a free block keeps its hash, so it is
still a prefix-cache hit until ``get_new_blocks`` pops it for reuse, which evicts it. A prefix
hit on a free block takes it out of the queue again (``touch``).

Algorithm per request, as the scheduler drives it: ``find_longest_prefix`` + ``touch`` for the
hit, ``get_new_blocks`` for the rest, ``cache_blocks`` as blocks fill up, and ``free_blocks``
(in reverse order) when the request finishes or is preempted.

When events are enabled the pool records ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` for the global block index; ``take_events`` drains them. With a host
tier (engine/core/kv_tiers.py) the blocks an allocation evicts go to ``on_evict`` instead, which
demotes them and records what happened to each (``record_event``; consecutive events of one
kind are merged, so a step's demotions are one event).

API: ``KVCacheBlock``, ``FreeBlockQueue``, ``BlockPool``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

from pdcluster.core.events import (
    AllBlocksCleared,
    BlockMoved,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from pdcluster.core.types import BlockHash

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False, repr=False)
class KVCacheBlock:
    """One KV block's metadata. Identity semantics: two blocks are never "equal"."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Links of the free queue; both None while the block is not in it.
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        # Show neighbours by id only: the default repr would recurse through the whole list.
        prev_id = self.prev_free.block_id if self.prev_free else None
        next_id = self.next_free.block_id if self.next_free else None
        block_hash = self.block_hash.hex()[:16] if self.block_hash else None
        return (f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
                f"block_hash={block_hash}, prev_free={prev_id}, next_free={next_id})")


class FreeBlockQueue:
    """Doubly linked list of free blocks, least recently freed at the head.

    A hand-rolled list rather than a deque because a prefix hit must take a block out of
    the middle in O(1). Sentinel head and tail keep every operation branch-free.
    """

    __slots__ = ("_head", "_tail", "num_free")

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.num_free = 0
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the least recently freed block."""
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("popleft from an empty FreeBlockQueue")
        assert block is not None, "free queue head lost its link"
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` (which must be in the queue) in O(1)."""
        prev_block, next_block = block.prev_free, block.next_free
        assert prev_block is not None and next_block is not None, f"{block} is not free"
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Add ``block`` at the tail: it becomes the most recently freed."""
        assert block.prev_free is None and block.next_free is None, f"{block} is already free"
        last = self._tail.prev_free
        assert last is not None, "free queue tail lost its link"
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head (next to be evicted) first. O(n): for tests and debugging."""
        blocks: list[KVCacheBlock] = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            blocks.append(block)
            block = block.next_free
        return blocks


class BlockPool:
    """Allocates KV blocks and keeps the prefix cache ``block_hash -> block``."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        enable_events: bool = False,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self._events: list[KVEvent] = []
        # (block id, hash) of every cached block an allocation evicts, before it is reused;
        # None: they are dropped (BlockRemoved)
        self.on_evict: Callable[[list[tuple[int, BlockHash]]], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (``ref_cnt > 0``); cached free blocks count as free."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def cached_block_map(self) -> Mapping[BlockHash, KVCacheBlock]:
        """Read-only view of the prefix cache, for checks and metrics."""
        return MappingProxyType(self._cached)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the LRU head (evicting their cached hashes), ref_cnt 1 each."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks, only {self.num_free_blocks} free")
        blocks = [self.free_block_queue.popleft() for _ in range(n)]
        removed: list[tuple[int, BlockHash]] = []
        for block in blocks:
            assert block.ref_cnt == 0, f"free block {block} has references"
            if block.block_hash is not None:
                removed.append((block.block_id, block.block_hash))
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
        if removed:
            if self.on_evict is not None:
                self.on_evict(removed)
            elif self.enable_events:
                self._events.append(BlockRemoved(tuple(h for _, h in removed)))
        return blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def find_longest_prefix(self, block_hashes: Sequence[BlockHash]) -> list[KVCacheBlock]:
        """Cached blocks of the longest cached prefix of a hash chain; ref counts unchanged."""
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes:
            block = self._cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the LRU queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        parent_hash: BlockHash | None,
    ) -> None:
        """Give just-filled blocks their hashes so later requests can hit them.

        ``block_hashes[i]`` belongs to ``blocks[i]``; ``parent_hash`` is the hash preceding
        ``block_hashes[0]`` in its chain (None for the first block of a sequence). A block
        already holding its hash is left alone; a hash already cached by another block (two
        requests computed the same block concurrently) leaves this block uncached, so it is
        recycled as a plain block when freed. One ``BlockStored`` event is recorded per
        contiguous run of newly stored hashes.
        """
        if len(blocks) != len(block_hashes):
            raise ValueError(f"{len(blocks)} blocks but {len(block_hashes)} hashes")
        if not self.enable_caching:
            return
        run: list[BlockHash] = []
        run_parent = parent_hash
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes, strict=True)):
            if self._store(block, block_hash):
                if not run:
                    run_parent = block_hashes[i - 1] if i > 0 else parent_hash
                run.append(block_hash)
            elif run:
                self._record_stored(run, run_parent)
                run = []
        if run:
            self._record_stored(run, run_parent)

    def _store(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Cache ``block`` under ``block_hash``; True if the hash is newly stored."""
        assert block.ref_cnt > 0, f"caching {block}, which no request holds"
        if block.block_hash is not None:
            assert block.block_hash == block_hash, (
                f"{block} already cached under another hash than {block_hash.hex()}")
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def _record_stored(self, run: list[BlockHash], parent_hash: BlockHash | None) -> None:
        if self.enable_events:
            self._events.append(BlockStored(tuple(run), parent_hash, self.block_size))

    def record_event(self, event: BlockRemoved | BlockMoved) -> None:
        """Record a tier change (engine/core/kv_tiers.py), merged into the previous event when
        that is of the same kind and media."""
        if not self.enable_events:
            return
        last = self._events[-1] if self._events else None
        if type(last) is type(event) and _same_media(last, event):
            assert isinstance(last, BlockRemoved | BlockMoved), "merging a non-tier event"
            self._events[-1] = replace(last, block_hashes=last.block_hashes + event.block_hashes)
        else:
            self._events.append(event)

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the LRU tail.

        Blocks are queued in the order given, and the first queued is evicted first. So a
        request frees its blocks in REVERSE order: a chain's tail is evicted before its head,
        and the cached prefix that other requests can still hit stays intact longest.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash, if no block is in use; False (and no change) otherwise."""
        num_used = self.num_blocks - self.num_free_blocks
        if num_used:
            logger.warning("prefix cache not reset: %d blocks still in use", num_used)
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """Return the events recorded since the last call and forget them."""
        events, self._events = self._events, []
        return events


def _same_media(a: KVEvent, b: KVEvent) -> bool:
    if isinstance(a, BlockRemoved) and isinstance(b, BlockRemoved):
        return a.medium == b.medium
    if isinstance(a, BlockMoved) and isinstance(b, BlockMoved):
        return (a.src, a.dst) == (b.src, b.dst)
    return False
