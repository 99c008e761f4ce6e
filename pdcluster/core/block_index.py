"""The global block index: which live node holds which block hash, and prefix queries over it.

Representation: every node gets a small integer slot; the index maps ``block_hash -> bitmap``
(a Python int, bit ``slot`` set when that node holds the block), and each node keeps the set
of its own hashes (needed to drop a node or clear it in O(its blocks), and to snapshot it).
Slots of removed nodes are reused, so bitmaps stay as narrow as the number of live nodes.

Prefix query (the hot path, called on every request): start from the bitmap of candidate
nodes and walk the chain; at block i, AND the running bitmap with the block's bitmap; nodes
whose bit drops out hold exactly i leading blocks. Stop when no candidate is left. Cost:
one dict lookup and two int operations per block of the shared prefix, independent of the
number of nodes (up to a machine word of nodes, and cheaply beyond).

Tiers: a node may hold a block's copy on several media (``core.events``: device, host, disk).
Membership (the bitmaps, the prefix query) counts a block held on any medium; a per-node map
keeps the media of the blocks that are not on the device alone (a bit mask per block, absent
= device only), so ``lower_tiers`` can say how many of a node's leading blocks must be loaded
from a slower tier. A node with no lower tier pays nothing for it.

Not thread-safe by design: one owner mutates and queries it (the metadata service's event
loop; the router's mirror of it, fed by the service's WatchBlocks stream, on the router's loop).
The public mutators never call one another (they share private helpers), so a subclass can
observe each change exactly once (``metadata_service.watch.WatchedIndex`` does).

API: ``BlockIndex`` with ``add_node``, ``remove_node``, ``add_blocks``, ``remove_blocks``,
``move_blocks``, ``clear_node``, ``replace_node_blocks``, ``node_blocks``, ``node_media``,
``query``, ``lower_tiers``, ``check_invariants``; ``MEDIUM_BITS``, ``medium_bit``;
``apply_events`` (a node's ``core.events`` applied in order).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from pdcluster.core.events import (
    DEVICE,
    DISK,
    HOST,
    MEDIA,
    AllBlocksCleared,
    BlockMoved,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from pdcluster.core.types import BlockHash, NodeId

MEDIUM_BITS = {medium: 1 << i for i, medium in enumerate(MEDIA)}
_DEVICE, _HOST, _DISK = MEDIUM_BITS[DEVICE], MEDIUM_BITS[HOST], MEDIUM_BITS[DISK]
_ALL_MEDIA = _DEVICE | _HOST | _DISK


def medium_bit(medium: str | None) -> int:
    """The mask bit of a medium (None: every medium); ValueError for an unknown one."""
    if medium is None:
        return _ALL_MEDIA
    bit = MEDIUM_BITS.get(medium)
    if bit is None:
        raise ValueError(f"medium must be one of {MEDIA}, got {medium!r}")
    return bit


class BlockIndex:
    __slots__ = ("_bitmaps", "_free_slots", "_node_blocks", "_slot_of", "_node_of",
                 "_num_entries", "_media")

    def __init__(self) -> None:
        self._bitmaps: dict[BlockHash, int] = {}
        self._slot_of: dict[NodeId, int] = {}
        self._node_of: dict[int, NodeId] = {}
        self._node_blocks: dict[NodeId, set[BlockHash]] = {}
        # per node: media masks of the blocks not held on the device alone
        self._media: dict[NodeId, dict[BlockHash, int]] = {}
        self._free_slots: list[int] = []
        self._num_entries = 0

    @property
    def num_blocks(self) -> int:
        """Distinct block hashes held by at least one node."""
        return len(self._bitmaps)

    @property
    def num_entries(self) -> int:
        """(block, node) pairs."""
        return self._num_entries

    @property
    def node_ids(self) -> list[NodeId]:
        return list(self._slot_of)

    def has_node(self, node_id: NodeId) -> bool:
        return node_id in self._slot_of

    def add_node(self, node_id: NodeId) -> None:
        """Give the node a slot (no-op if it has one)."""
        if node_id in self._slot_of:
            return
        slot = self._free_slots.pop() if self._free_slots else len(self._slot_of)
        self._slot_of[node_id] = slot
        self._node_of[slot] = node_id
        self._node_blocks[node_id] = set()
        self._media[node_id] = {}

    def remove_node(self, node_id: NodeId) -> int:
        """Drop the node and all of its blocks; returns how many blocks it held."""
        if node_id not in self._slot_of:
            return 0
        num_removed = self._remove_blocks(node_id, list(self._node_blocks[node_id]))
        slot = self._slot_of.pop(node_id)
        del self._node_of[slot]
        del self._node_blocks[node_id]
        del self._media[node_id]
        self._free_slots.append(slot)
        return num_removed

    def add_blocks(self, node_id: NodeId, block_hashes: Iterable[BlockHash],
                   medium: str = DEVICE) -> int:
        """Record that the node holds a copy of these blocks on ``medium``; returns how many
        were new for the node."""
        return self._add_blocks(node_id, block_hashes, medium_bit(medium))

    def remove_blocks(self, node_id: NodeId, block_hashes: Iterable[BlockHash],
                      medium: str | None = None) -> int:
        """Forget the node's copies of these blocks on ``medium`` (None: every copy; unknown
        blocks are ignored); returns how many blocks the node no longer holds at all."""
        if medium is None:
            return self._remove_blocks(node_id, block_hashes)
        return self._drop_medium(node_id, block_hashes, medium_bit(medium))

    def move_blocks(self, node_id: NodeId, block_hashes: Iterable[BlockHash], src: str,
                    dst: str) -> int:
        """The node's copies of these blocks moved from ``src`` to ``dst`` (a block the index
        did not know for the node is added on ``dst``); returns how many were new."""
        src_bit, dst_bit = medium_bit(src), medium_bit(dst)
        hashes = list(block_hashes)
        num_new = self._add_blocks(node_id, hashes, dst_bit)
        if src_bit != dst_bit:
            self._drop_medium(node_id, hashes, src_bit)
        return num_new

    def clear_node(self, node_id: NodeId) -> int:
        """Forget every block of the node, keeping its slot."""
        return self._remove_blocks(node_id, list(self._node_blocks[node_id]))

    def replace_node_blocks(
        self, node_id: NodeId, block_hashes: Iterable[BlockHash],
        media: Mapping[BlockHash, int] | None = None,
    ) -> tuple[set[BlockHash], set[BlockHash]]:
        """Make the node's set exactly ``block_hashes`` (a snapshot), touching only the diff,
        with ``media`` the masks of the blocks not on the device alone (None: all on the
        device); returns the membership diff as (removed, added)."""
        wanted = set(block_hashes)
        owned = self._node_blocks[node_id]
        removed, added = owned - wanted, wanted - owned
        self._remove_blocks(node_id, removed)
        self._add_blocks(node_id, added, _DEVICE)
        self._media[node_id] = {h: m & _ALL_MEDIA for h, m in (media or {}).items()
                                if h in wanted and m & _ALL_MEDIA not in (0, _DEVICE)}
        return removed, added

    def _add_blocks(self, node_id: NodeId, block_hashes: Iterable[BlockHash],
                    medium: int = _DEVICE) -> int:
        bit = 1 << self._slot_of[node_id]
        owned = self._node_blocks[node_id]
        media = self._media[node_id]
        bitmaps = self._bitmaps
        before = len(owned)
        for block_hash in block_hashes:
            if block_hash not in owned:
                owned.add(block_hash)
                bitmaps[block_hash] = bitmaps.get(block_hash, 0) | bit
                if medium != _DEVICE:
                    media[block_hash] = medium
            elif medium != _DEVICE or block_hash in media:
                mask = media.get(block_hash, _DEVICE) | medium
                if mask == _DEVICE:
                    media.pop(block_hash, None)
                else:
                    media[block_hash] = mask
        num_new = len(owned) - before
        self._num_entries += num_new
        return num_new

    def _drop_medium(self, node_id: NodeId, block_hashes: Iterable[BlockHash],
                     medium: int) -> int:
        """Clear ``medium`` from the blocks' masks; blocks left with none leave the node."""
        owned = self._node_blocks[node_id]
        media = self._media[node_id]
        gone = []
        for block_hash in block_hashes:
            if block_hash not in owned:
                continue
            mask = media.get(block_hash, _DEVICE) & ~medium
            if mask == 0:
                gone.append(block_hash)
            elif mask == _DEVICE:
                media.pop(block_hash, None)
            else:
                media[block_hash] = mask
        return self._remove_blocks(node_id, gone) if gone else 0

    def _remove_blocks(self, node_id: NodeId, block_hashes: Iterable[BlockHash]) -> int:
        mask = ~(1 << self._slot_of[node_id])
        owned = self._node_blocks[node_id]
        media = self._media[node_id]
        bitmaps = self._bitmaps
        before = len(owned)
        for block_hash in block_hashes:
            if block_hash in owned:
                owned.discard(block_hash)
                if media:
                    media.pop(block_hash, None)
                remaining = bitmaps[block_hash] & mask
                if remaining:
                    bitmaps[block_hash] = remaining
                else:
                    del bitmaps[block_hash]
        num_removed = before - len(owned)
        self._num_entries -= num_removed
        return num_removed

    def holds(self, node_id: NodeId, block_hash: BlockHash) -> bool:
        return block_hash in self._node_blocks[node_id]

    def node_blocks(self, node_id: NodeId) -> frozenset[BlockHash]:
        return frozenset(self._node_blocks[node_id])

    def num_node_blocks(self, node_id: NodeId) -> int:
        return len(self._node_blocks[node_id])

    def node_media(self, node_id: NodeId) -> dict[BlockHash, int]:
        """A copy of the media masks of the node's blocks not on the device alone."""
        return dict(self._media[node_id])

    def num_lower_blocks(self, node_id: NodeId) -> int:
        """The node's blocks with no copy on the device."""
        return sum(1 for mask in self._media[node_id].values() if not mask & _DEVICE)

    def lower_tiers(self, node_id: NodeId, block_hashes: Sequence[BlockHash]) -> tuple[int, int]:
        """Of these blocks (which the node holds), how many have their fastest copy on the
        host, and how many on disk: what the node must load before it can use them."""
        media = self._media.get(node_id)
        if not media:
            return 0, 0
        num_host = num_disk = 0
        for block_hash in block_hashes:
            mask = media.get(block_hash, _DEVICE)
            if not mask & _DEVICE:
                if mask & _HOST:
                    num_host += 1
                else:
                    num_disk += 1
        return num_host, num_disk

    def query(
        self,
        block_hashes: Sequence[BlockHash],
        candidates: Iterable[NodeId] | None = None,
        include_zero: bool = False,
    ) -> list[tuple[NodeId, int]]:
        """(node, leading blocks held) for every candidate, best first, ties by node id.

        ``candidates`` None means every node. Nodes holding no leading block are listed only
        with ``include_zero``.
        """
        alive = self._candidate_mask(candidates)
        counts: list[tuple[NodeId, int]] = []
        if alive == 0:
            return counts
        bitmaps = self._bitmaps
        depth = 0
        for block_hash in block_hashes:
            held = alive & bitmaps.get(block_hash, 0)
            if held != alive:
                self._collect(alive & ~held, depth, counts, include_zero)
                alive = held
                if not alive:
                    break
            depth += 1
        if alive:
            self._collect(alive, depth, counts, include_zero)
        counts.sort(key=_best_first)
        return counts

    def _candidate_mask(self, candidates: Iterable[NodeId] | None) -> int:
        if candidates is None:
            mask = 0
            for slot in self._node_of:
                mask |= 1 << slot
            return mask
        mask = 0
        slot_of = self._slot_of
        for node_id in candidates:
            found = slot_of.get(node_id)
            if found is not None:
                mask |= 1 << found
        return mask

    def _collect(
        self, mask: int, depth: int, out: list[tuple[NodeId, int]], include_zero: bool
    ) -> None:
        if depth == 0 and not include_zero:
            return
        node_of = self._node_of
        while mask:
            low = mask & -mask
            out.append((node_of[low.bit_length() - 1], depth))
            mask ^= low

    def check_invariants(self) -> None:
        """Assert that bitmaps and per-node sets describe the same relation (for tests)."""
        entries = 0
        for node_id, owned in self._node_blocks.items():
            bit = 1 << self._slot_of[node_id]
            for block_hash in owned:
                assert self._bitmaps[block_hash] & bit, f"{node_id} missing bit for a block"
            entries += len(owned)
        assert entries == self._num_entries, f"{entries} entries, counter {self._num_entries}"
        for node_id, media in self._media.items():
            owned = self._node_blocks[node_id]
            for block_hash, mask in media.items():
                assert block_hash in owned, f"{node_id}: media of a block it does not hold"
                assert mask & _ALL_MEDIA == mask and mask not in (0, _DEVICE), \
                    f"{node_id}: media mask {mask} kept for a block"
        bits = sum(bin(bitmap).count("1") for bitmap in self._bitmaps.values())
        assert bits == entries, f"{bits} bits set, {entries} entries"
        assert all(self._bitmaps.values()), "an empty bitmap left in the index"


def apply_events(index: BlockIndex, node_id: NodeId, events: Iterable[KVEvent]) -> None:
    """Apply one node's events, in order (the replay's nodes, tests)."""
    for event in events:
        if isinstance(event, BlockStored):
            index.add_blocks(node_id, event.block_hashes, event.medium)
        elif isinstance(event, BlockMoved):
            index.move_blocks(node_id, event.block_hashes, event.src, event.dst)
        elif isinstance(event, BlockRemoved):
            index.remove_blocks(node_id, event.block_hashes, event.medium)
        elif isinstance(event, AllBlocksCleared):
            index.clear_node(node_id)


def _best_first(item: tuple[NodeId, int]) -> tuple[int, NodeId]:
    return (-item[1], item[0])
