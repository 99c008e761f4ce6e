"""`KVTiers`: the device block pool with a host tier below it (torch-free bookkeeping; the
copies themselves run in `engine.host_kv_cache`).

- **Demotion.** When an allocation evicts a cached device block (its slot is about to be
  reused), the block is copied to a host slot instead of being dropped: the host's LRU makes
  room (its least recently used unpinned block goes for good), the copy is queued and the
  index is told with one `BlockMoved(device -> host)`. A block whose host copy still exists
  (it was loaded back earlier) costs no copy: `BlockRemoved(device)`, the host copy is
  touched.
- **Lookup.** `longest_prefix` walks a request's chain through the device's prefix cache and,
  where a block is not there, the host's: the hits are device blocks and `HostHit`s, in
  chain order, up to the first block neither holds.
- **Load-back.** `load` pins a host hit's slot and queues its copy into a fresh device block
  that the caller then caches under the hash (`BlockStored(device)`: the block has both
  copies now, so demoting it again copies nothing).
- **Copies.** Queued copies run once per step, after scheduling and before the model writes
  any block (`take_copies`, then `copies_done`): all demotions first (a slot reused in this
  step keeps its old bytes until they are saved), then all loads. A pinned host slot is
  never evicted, so a load cannot read a slot a later demotion of the same step reused.

API: `KVTiers`, `HostHit`, `TierCopies`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdcluster.core.block_index import MEDIUM_BITS
from pdcluster.core.events import DEVICE, HOST, BlockMoved, BlockRemoved
from pdcluster.core.types import BlockHash
from pdcluster.engine.block_pool import BlockPool, KVCacheBlock
from pdcluster.engine.host_pool import HostBlockPool

_DEVICE_BIT, _HOST_BIT = MEDIUM_BITS[DEVICE], MEDIUM_BITS[HOST]


@dataclass(frozen=True, slots=True)
class HostHit:
    """A prefix-hit block found in the host tier only."""

    block_hash: BlockHash
    slot: int


@dataclass(slots=True)
class TierCopies:
    """One step's copies: (device block, host slot) demotions, (host slot, device block)
    loads."""

    demotions: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.demotions or self.loads)


class KVTiers:
    def __init__(self, pool: BlockPool, host: HostBlockPool) -> None:
        self.pool = pool
        self.host = host
        self._copies = TierCopies()
        self.num_demoted = 0  # blocks copied to the host
        self.num_loaded = 0  # blocks copied back to the device
        self.num_host_evicted = 0  # host blocks dropped for room
        pool.on_evict = self._demote

    # ---- lookup and load-back --------------------------------------------------------

    def longest_prefix(self, block_hashes: Sequence[BlockHash]
                       ) -> list[KVCacheBlock | HostHit]:
        hits: list[KVCacheBlock | HostHit] = []
        pool, host = self.pool, self.host
        for block_hash in block_hashes:
            block = pool.get_cached_block(block_hash)
            if block is not None:
                hits.append(block)
                continue
            slot = host.lookup(block_hash)
            if slot is None:
                break
            hits.append(HostHit(block_hash, slot))
        return hits

    def pin(self, hits: Sequence[HostHit]) -> None:
        """Keep these hits' host copies until their loads ran (call before allocating the
        device blocks they load into: that allocation may demote, and demoting evicts)."""
        for hit in hits:
            self.host.touch(hit.block_hash)
            self.host.pin(hit.slot)

    def unpin(self, hits: Sequence[HostHit]) -> None:
        """Let pinned hits' slots go again (a peer's pull served from them is done)."""
        for hit in hits:
            self.host.unpin(hit.slot)

    def load(self, hit: HostHit, block: KVCacheBlock) -> None:
        """Queue the copy of a pinned host hit into `block` (which the caller caches under
        the hit's hash)."""
        assert self.host.lookup(hit.block_hash) == hit.slot, "loading a host slot that moved"
        self._copies.loads.append((hit.slot, block.block_id))
        self.num_loaded += 1

    # ---- demotion ----------------------------------------------------------------------

    def _demote(self, evicted: list[tuple[int, BlockHash]]) -> None:
        pool, host = self.pool, self.host
        for block_id, block_hash in evicted:
            if host.lookup(block_hash) is not None:
                host.touch(block_hash)
                pool.record_event(BlockRemoved((block_hash,), DEVICE))
                continue
            slot, dropped = host.allocate(block_hash)
            for gone in dropped:
                pool.record_event(BlockRemoved((gone,), HOST))
            self.num_host_evicted += len(dropped)
            if slot is None:  # every host slot has a copy pending: this block is lost
                pool.record_event(BlockRemoved((block_hash,), DEVICE))
                continue
            host.pin(slot)
            self._copies.demotions.append((block_id, slot))
            self.num_demoted += 1
            pool.record_event(BlockMoved((block_hash,), DEVICE, HOST))

    # ---- the step's copies -------------------------------------------------------------

    def take_copies(self) -> TierCopies:
        copies, self._copies = self._copies, TierCopies()
        return copies

    def copies_done(self, copies: TierCopies) -> None:
        """The copies ran: their host slots may be evicted again."""
        for _, slot in copies.demotions:
            self.host.unpin(slot)
        for slot, _ in copies.loads:
            self.host.unpin(slot)

    # ---- whole-cache views -------------------------------------------------------------

    def reset(self) -> bool:
        """Drop both tiers (one `AllBlocksCleared`), if no block is in use."""
        if self._copies or not self.pool.reset_prefix_cache():
            return False
        cleared = self.host.clear()
        assert cleared, "host slots pinned with no copy pending"
        return True

    def stats(self) -> dict[str, float]:
        host = self.host
        return {"num_host_blocks": host.num_slots, "num_host_cached": host.num_cached,
                "num_host_pinned": host.num_pinned, "num_demoted_blocks": self.num_demoted,
                "num_loaded_blocks": self.num_loaded,
                "num_host_evicted_blocks": self.num_host_evicted}

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash either tier holds."""
        return list(self.cached_media())

    def cached_media(self) -> dict[BlockHash, int]:
        """Every hash either tier holds -> its media mask (`core.block_index.MEDIUM_BITS`:
        1 device, 2 host). Safe from another thread (each tier's list is one atomic copy)."""
        device, host = list(self.pool.cached_block_map), self.host.cached_hashes()
        media = dict.fromkeys(device, _DEVICE_BIT)
        for block_hash in host:
            media[block_hash] = media.get(block_hash, 0) | _HOST_BIT
        return media
