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

Not thread-safe by design: one owner mutates and queries it (the metadata service's event
loop; the router's mirror of it, fed by the service's WatchBlocks stream, on the router's loop).
The public mutators never call one another (they share private helpers), so a subclass can
observe each change exactly once (``metadata_service.watch.WatchedIndex`` does).

API: ``BlockIndex`` with ``add_node``, ``remove_node``, ``add_blocks``, ``remove_blocks``,
``clear_node``, ``replace_node_blocks``, ``node_blocks``, ``query``, ``check_invariants``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pdcluster.core.types import BlockHash, NodeId


class BlockIndex:
    __slots__ = ("_bitmaps", "_free_slots", "_node_blocks", "_slot_of", "_node_of", "_num_entries")

    def __init__(self) -> None:
        self._bitmaps: dict[BlockHash, int] = {}
        self._slot_of: dict[NodeId, int] = {}
        self._node_of: dict[int, NodeId] = {}
        self._node_blocks: dict[NodeId, set[BlockHash]] = {}
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

    def remove_node(self, node_id: NodeId) -> int:
        """Drop the node and all of its blocks; returns how many blocks it held."""
        if node_id not in self._slot_of:
            return 0
        num_removed = self._remove_blocks(node_id, list(self._node_blocks[node_id]))
        slot = self._slot_of.pop(node_id)
        del self._node_of[slot]
        del self._node_blocks[node_id]
        self._free_slots.append(slot)
        return num_removed

    def add_blocks(self, node_id: NodeId, block_hashes: Iterable[BlockHash]) -> int:
        """Record that the node holds these blocks; returns how many were new for it."""
        return self._add_blocks(node_id, block_hashes)

    def remove_blocks(self, node_id: NodeId, block_hashes: Iterable[BlockHash]) -> int:
        """Forget these blocks of the node (unknown ones are ignored); returns how many went."""
        return self._remove_blocks(node_id, block_hashes)

    def clear_node(self, node_id: NodeId) -> int:
        """Forget every block of the node, keeping its slot."""
        return self._remove_blocks(node_id, list(self._node_blocks[node_id]))

    def replace_node_blocks(
        self, node_id: NodeId, block_hashes: Iterable[BlockHash]
    ) -> tuple[set[BlockHash], set[BlockHash]]:
        """Make the node's set exactly ``block_hashes`` (a snapshot), touching only the diff;
        returns the diff as (removed, added)."""
        wanted = set(block_hashes)
        owned = self._node_blocks[node_id]
        removed, added = owned - wanted, wanted - owned
        self._remove_blocks(node_id, removed)
        self._add_blocks(node_id, added)
        return removed, added

    def _add_blocks(self, node_id: NodeId, block_hashes: Iterable[BlockHash]) -> int:
        bit = 1 << self._slot_of[node_id]
        owned = self._node_blocks[node_id]
        bitmaps = self._bitmaps
        before = len(owned)
        for block_hash in block_hashes:
            if block_hash not in owned:
                owned.add(block_hash)
                bitmaps[block_hash] = bitmaps.get(block_hash, 0) | bit
        num_new = len(owned) - before
        self._num_entries += num_new
        return num_new

    def _remove_blocks(self, node_id: NodeId, block_hashes: Iterable[BlockHash]) -> int:
        mask = ~(1 << self._slot_of[node_id])
        owned = self._node_blocks[node_id]
        bitmaps = self._bitmaps
        before = len(owned)
        for block_hash in block_hashes:
            if block_hash in owned:
                owned.discard(block_hash)
                remaining = bitmaps[block_hash] & mask
                if remaining:
                    bitmaps[block_hash] = remaining
                else:
                    del bitmaps[block_hash]
        num_removed = before - len(owned)
        self._num_entries -= num_removed
        return num_removed

    def node_blocks(self, node_id: NodeId) -> frozenset[BlockHash]:
        return frozenset(self._node_blocks[node_id])

    def num_node_blocks(self, node_id: NodeId) -> int:
        return len(self._node_blocks[node_id])

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
        bits = sum(bin(bitmap).count("1") for bitmap in self._bitmaps.values())
        assert bits == entries, f"{bits} bits set, {entries} entries"
        assert all(self._bitmaps.values()), "an empty bitmap left in the index"


def _best_first(item: tuple[NodeId, int]) -> tuple[int, NodeId]:
    return (-item[1], item[0])
