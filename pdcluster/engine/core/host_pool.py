"""`HostBlockPool`: the bookkeeping of the host tier of the KV cache (torch-free; the bytes
live in `engine.kv.host_kv_cache.HostKVCache`), and of the disk tier below it, which keeps its
slots the same way (`engine.kv.disk_kv_cache.DiskKVCache` holds those bytes).

The host tier holds copies of blocks the device pool evicted, in `num_slots` slots of one
block each, as a prefix cache of its own: `hash -> slot`, least recently used first. A slot
is pinned while a copy into it or out of it is pending (the step's copies have not run yet),
and the LRU never evicts a pinned slot; everything else is evictable at any time, since a
host copy is only ever a cache (a block in use always lives on the device).

API: `HostBlockPool` with `lookup`, `touch`, `allocate`, `forget`, `pin`, `unpin`, `clear`,
`cached_hashes`, and the counts `num_cached`, `num_free`, `num_pinned`.
"""

from __future__ import annotations

from collections import OrderedDict

from pdcluster.core.types import BlockHash


class HostBlockPool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one block, got {num_slots}")
        self.num_slots = num_slots
        # Popped from the end, so the highest slot first: a chain is demoted tail first, and
        # descending slots put it back in chain order (its copies then merge into runs).
        self._free = list(range(num_slots))
        self._lru: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._pins: dict[int, int] = {}  # slot -> pending copies

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._lru.get(block_hash)

    def touch(self, block_hash: BlockHash) -> None:
        """The block was just used: least likely to be evicted next."""
        self._lru.move_to_end(block_hash)

    def allocate(self, block_hash: BlockHash) -> tuple[int | None, list[BlockHash]]:
        """A slot for `block_hash` (not cached yet), evicting least recently used unpinned
        blocks if none is free: (the slot, or None when every slot is pinned; the hashes
        evicted)."""
        assert block_hash not in self._lru, "allocating a host slot for a cached block"
        evicted: list[BlockHash] = []
        if not self._free:
            victim = next((h for h, slot in self._lru.items() if slot not in self._pins), None)
            if victim is None:
                return None, evicted
            self._free.append(self._lru.pop(victim))
            evicted.append(victim)
        slot = self._free.pop()
        self._lru[block_hash] = slot
        return slot, evicted

    def forget(self, slot: int) -> BlockHash | None:
        """Drop whatever block `slot` holds (its bytes are lost); that block's hash."""
        gone = next((h for h, s in self._lru.items() if s == slot), None)
        if gone is not None:
            del self._lru[gone]
            self._free.append(slot)
        return gone

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        count = self._pins.get(slot, 0)
        assert count > 0, f"host slot {slot} unpinned more often than pinned"
        if count == 1:
            del self._pins[slot]
        else:
            self._pins[slot] = count - 1

    def clear(self) -> bool:
        """Forget every cached block, if no copy is pending; False (no change) otherwise."""
        if self._pins:
            return False
        self._free.extend(self._lru.values())
        self._lru.clear()
        self._free.sort()
        return True

    def cached_hashes(self) -> list[BlockHash]:
        """Every cached hash, least recently used (next to be evicted) first; a copy, safe
        from another thread (list() of a dict of bytes runs under the GIL in one go)."""
        return list(self._lru)
