"""`KVTiers`: the device block pool with a host tier below it and, optionally, a disk tier
below that (torch-free bookkeeping; the copies themselves run in `engine.kv.host_kv_cache` and
`engine.kv.disk_kv_cache`).

- **Demotion.** When an allocation evicts a cached device block (its slot is about to be
  reused), the block is copied to a host slot instead of being dropped: the host's LRU makes
  room (its least recently used unpinned block goes for good), the copy is queued and the
  index is told with one `BlockMoved(device -> host)`. A block whose host copy still exists
  (it was loaded back earlier) costs no copy: `BlockRemoved(device)`, the host copy is
  touched.
- **Spill.** A host block the host's LRU evicts goes down to a disk slot (the disk's own LRU
  makes room: `BlockRemoved(disk)` for what it drops) with one `BlockMoved(host -> disk)`;
  its bytes are staged this step and written by the disk's writer thread. At most
  `max_pending_spills` writes may be pending: past that the spill is dropped
  (`BlockRemoved(host)`), never waited for. A block whose disk copy still exists costs no
  write. A disk slot is not a hit until its write finished (`writes_done`) — with tensor
  parallelism, until every one of the `num_ranks` ranks finished writing its slice of it.
- **Lookup.** `longest_prefix` walks a request's chain through the device's prefix cache and,
  where a block is not there, the host's, then the disk's: the hits are device blocks,
  `HostHit`s and `DiskHit`s, in chain order, up to the first block no tier holds. Peers'
  pulls look with `peer_prefix`: only the tiers a peer can read through the transfer engine.
- **Load-back.** `load` pins a host hit's slot and queues its copy into a fresh device block
  that the caller then caches under the hash (`BlockStored(device)`: the block has both
  copies now, so demoting it again copies nothing).
- **Copies.** Queued copies run once per step, after scheduling and before the model writes
  any block (`take_copies`, then `copies_done`): all spills first (host bytes staged before a
  demotion reuses their slot), then all demotions (a slot reused in this step keeps its old
  bytes until they are saved), then all loads (host, then disk). A pinned slot is never
  evicted, so a load cannot read a slot a later demotion of the same step reused. With tensor
  parallelism every rank runs the same copies on its own slice of the blocks, in a host tier
  (and a disk file) of its own with these slot numbers (engine/runner/tp_workers.py).

API: `KVTiers`, `HostHit`, `DiskHit`, `TierCopies`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdcluster.core.block_index import MEDIUM_BITS
from pdcluster.core.events import DEVICE, DISK, HOST, BlockMoved, BlockRemoved
from pdcluster.core.types import BlockHash
from pdcluster.engine.core.block_pool import BlockPool, KVCacheBlock
from pdcluster.engine.core.host_pool import HostBlockPool

_DEVICE_BIT, _HOST_BIT, _DISK_BIT = MEDIUM_BITS[DEVICE], MEDIUM_BITS[HOST], MEDIUM_BITS[DISK]


@dataclass(frozen=True, slots=True)
class HostHit:
    """A prefix-hit block found in the host tier only."""

    block_hash: BlockHash
    slot: int


@dataclass(frozen=True, slots=True)
class DiskHit:
    """A prefix-hit block found in the disk tier only."""

    block_hash: BlockHash
    slot: int


LowerHit = HostHit | DiskHit


@dataclass(slots=True)
class TierCopies:
    """One step's copies: (host slot, disk slot) spills, (device block, host slot)
    demotions, (host slot, device block) loads, (disk slot, device block) disk loads."""

    demotions: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)
    spills: list[tuple[int, int]] = field(default_factory=list)
    disk_loads: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.demotions or self.loads or self.spills or self.disk_loads)


class KVTiers:
    def __init__(self, pool: BlockPool, host: HostBlockPool, disk: HostBlockPool | None = None,
                 max_pending_spills: int = 64, num_ranks: int = 1) -> None:
        self.pool = pool
        self.host = host
        self.disk = disk  # its slots, LRU and pins: the same bookkeeping as the host's
        self.max_pending_spills = max_pending_spills
        self.num_ranks = num_ranks  # tensor-parallel ranks, each writing its slice to disk
        self._copies = TierCopies()
        # disk slots whose write has not finished on every rank -> the ranks' outcomes so far
        self._spilling: dict[int, list[bool]] = {}
        self.num_demoted = 0  # blocks copied to the host
        self.num_loaded = 0  # blocks copied back to the device (from host or disk)
        self.num_host_evicted = 0  # host blocks dropped for room (spilled ones included)
        self.num_spilled = 0  # host blocks queued for the disk
        self.num_spills_dropped = 0  # spills dropped: too many writes pending
        self.num_disk_loaded = 0  # blocks read back from the disk
        self.num_disk_evicted = 0  # disk blocks dropped for room
        pool.on_evict = self._demote

    # ---- lookup and load-back --------------------------------------------------------

    def longest_prefix(self, block_hashes: Sequence[BlockHash], include_disk: bool = True
                       ) -> list[KVCacheBlock | LowerHit]:
        hits: list[KVCacheBlock | LowerHit] = []
        pool, host = self.pool, self.host
        disk = self.disk if include_disk else None
        for block_hash in block_hashes:
            block = pool.get_cached_block(block_hash)
            if block is not None:
                hits.append(block)
                continue
            slot = host.lookup(block_hash)
            if slot is not None:
                hits.append(HostHit(block_hash, slot))
                continue
            slot = disk.lookup(block_hash) if disk is not None else None
            if slot is None or slot in self._spilling:
                break
            hits.append(DiskHit(block_hash, slot))
        return hits

    def peer_prefix(self, block_hashes: Sequence[BlockHash]) -> list[KVCacheBlock | LowerHit]:
        """`longest_prefix` for a peer's pull: only the tiers a peer reads through the
        transfer engine. Never the disk (its file is not registered). The host, also at
        tensor_parallel_size > 1: every rank registers its own host tier (slot for slot rank
        0's) with its transfer engine, and transfer/group_writer.py plans each rank's share."""
        return self.longest_prefix(block_hashes, include_disk=False)

    def _tier(self, hit: LowerHit) -> HostBlockPool:
        if isinstance(hit, HostHit):
            return self.host
        assert self.disk is not None, "a disk hit without a disk tier"
        return self.disk

    def pin(self, hits: Sequence[LowerHit]) -> None:
        """Keep these hits' copies until their loads ran (call before allocating the device
        blocks they load into: that allocation may demote, and demoting evicts)."""
        for hit in hits:
            tier = self._tier(hit)
            tier.touch(hit.block_hash)
            tier.pin(hit.slot)

    def unpin(self, hits: Sequence[LowerHit]) -> None:
        """Let pinned hits' slots go again (a peer's pull served from them is done)."""
        for hit in hits:
            self._tier(hit).unpin(hit.slot)

    def load(self, hit: LowerHit, block: KVCacheBlock) -> None:
        """Queue the copy of a pinned hit into `block` (which the caller caches under the
        hit's hash)."""
        assert self._tier(hit).lookup(hit.block_hash) == hit.slot, "loading a slot that moved"
        if isinstance(hit, HostHit):
            self._copies.loads.append((hit.slot, block.block_id))
        else:
            self._copies.disk_loads.append((hit.slot, block.block_id))
            self.num_disk_loaded += 1
        self.num_loaded += 1

    # ---- demotion ----------------------------------------------------------------------

    def _demote(self, evicted: list[tuple[int, BlockHash]]) -> None:
        pool, host = self.pool, self.host
        # Each demotion pins its slot until the step's copies ran, so a burst larger than the
        # unpinned slots cannot all fit. `evicted` comes least recently freed first, each
        # chain tail first: skipping the first ones loses the coldest chain's tail and keeps
        # heads (a chain without its head is no prefix hit at all).
        need = sum(1 for _, block_hash in evicted if host.lookup(block_hash) is None)
        skip = max(0, need - (host.num_slots - host.num_pinned))
        for block_id, block_hash in evicted:
            if host.lookup(block_hash) is not None:
                host.touch(block_hash)
                pool.record_event(BlockRemoved((block_hash,), DEVICE))
                continue
            if skip:
                skip -= 1
                pool.record_event(BlockRemoved((block_hash,), DEVICE))
                continue
            slot, dropped = host.allocate(block_hash)
            for gone in dropped:  # at most one, and its slot is the one just handed out
                assert slot is not None, "a host block evicted but no slot returned"
                self._spill(gone, slot)
            self.num_host_evicted += len(dropped)
            if slot is None:  # every host slot has a copy pending: this block is lost
                pool.record_event(BlockRemoved((block_hash,), DEVICE))
                continue
            host.pin(slot)
            self._copies.demotions.append((block_id, slot))
            self.num_demoted += 1
            pool.record_event(BlockMoved((block_hash,), DEVICE, HOST))

    def _spill(self, block_hash: BlockHash, host_slot: int) -> None:
        """The host evicts `block_hash` from `host_slot`: down to the disk, if it can."""
        pool, disk = self.pool, self.disk
        if disk is not None and disk.lookup(block_hash) is not None:
            disk.touch(block_hash)  # its disk copy is still there: no write
            pool.record_event(BlockRemoved((block_hash,), HOST))
            return
        if disk is None or len(self._spilling) >= self.max_pending_spills:
            self.num_spills_dropped += disk is not None
            pool.record_event(BlockRemoved((block_hash,), HOST))
            return
        slot, dropped = disk.allocate(block_hash)
        for gone in dropped:
            pool.record_event(BlockRemoved((gone,), DISK))
        self.num_disk_evicted += len(dropped)
        if slot is None:  # every disk slot is pinned
            pool.record_event(BlockRemoved((block_hash,), HOST))
            return
        disk.pin(slot)
        self._spilling[slot] = []
        self._copies.spills.append((host_slot, slot))
        self.num_spilled += 1
        pool.record_event(BlockMoved((block_hash,), HOST, DISK))

    def writes_done(self, written: Sequence[tuple[int, bool]]) -> None:
        """One rank's disk writer finished these (slot, ok) writes. Once every rank's has
        finished a slot, it is a hit from then on if every write went well, else forgotten
        (`BlockRemoved(disk)`)."""
        disk = self.disk
        assert disk is not None or not written, "disk writes without a disk tier"
        for slot, ok in written:
            assert disk is not None and slot in self._spilling, f"disk slot {slot} not spilling"
            outcomes = self._spilling[slot]
            outcomes.append(ok)
            if len(outcomes) < self.num_ranks:
                continue
            del self._spilling[slot]
            disk.unpin(slot)
            if not all(outcomes):
                gone = disk.forget(slot)
                if gone is not None:
                    self.pool.record_event(BlockRemoved((gone,), DISK))

    @property
    def num_pending_spills(self) -> int:
        return len(self._spilling)

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
        for slot, _ in copies.disk_loads:
            assert self.disk is not None, "a disk load without a disk tier"
            self.disk.unpin(slot)

    # ---- whole-cache views -------------------------------------------------------------

    def reset(self) -> bool:
        """Drop every tier (one `AllBlocksCleared`), if no block is in use and no disk
        write is pending (the caller drains the writer first)."""
        if self._copies or self._spilling or not self.pool.reset_prefix_cache():
            return False
        cleared = self.host.clear() and (self.disk is None or self.disk.clear())
        assert cleared, "tier slots pinned with no copy pending"
        return True

    def stats(self) -> dict[str, float]:
        host, disk = self.host, self.disk
        stats: dict[str, float] = {
            "num_host_blocks": host.num_slots, "num_host_cached": host.num_cached,
            "num_host_pinned": host.num_pinned, "num_demoted_blocks": self.num_demoted,
            "num_loaded_blocks": self.num_loaded, "num_host_evicted_blocks": self.num_host_evicted}
        if disk is not None:
            stats |= {"num_disk_blocks": disk.num_slots, "num_disk_cached": disk.num_cached,
                      "num_spilled_blocks": self.num_spilled,
                      "num_spills_dropped": self.num_spills_dropped,
                      "num_disk_loaded_blocks": self.num_disk_loaded,
                      "num_disk_evicted_blocks": self.num_disk_evicted}
        return stats

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash any tier holds."""
        return list(self.cached_media())

    def cached_media(self) -> dict[BlockHash, int]:
        """Every hash any tier holds -> its media mask (`core.block_index.MEDIUM_BITS`:
        1 device, 2 host, 4 disk). Safe from another thread (each tier's list is one atomic
        copy)."""
        device, host = list(self.pool.cached_block_map), self.host.cached_hashes()
        disk = self.disk.cached_hashes() if self.disk is not None else []
        media = dict.fromkeys(device, _DEVICE_BIT)
        for block_hash in host:
            media[block_hash] = media.get(block_hash, 0) | _HOST_BIT
        for block_hash in disk:
            media[block_hash] = media.get(block_hash, 0) | _DISK_BIT
        return media
