"""Shared test helpers: leak checks that scenario tests run after freeing everything."""

from __future__ import annotations

import itertools

from pdcluster.engine.core.block_pool import BlockPool
from pdcluster.engine.core.kv_tiers import KVTiers


def assert_pool_clean(pool: BlockPool) -> None:
    """Assert that no block is held and that the free queue and prefix cache are consistent."""
    held = [block for block in pool.blocks if block.ref_cnt != 0]
    assert not held, f"blocks still referenced: {held}"
    assert pool.num_free_blocks == pool.num_blocks, (
        f"{pool.num_free_blocks} free blocks, expected {pool.num_blocks}")
    free = pool.free_block_queue.get_all_free_blocks()
    free_ids = sorted(block.block_id for block in free)
    assert free_ids == list(range(pool.num_blocks)), f"free queue ids: {free_ids}"
    _assert_links_consistent(free)
    cached = pool.cached_block_map
    for block in pool.blocks:
        if block.block_hash is not None:
            assert cached.get(block.block_hash) is block, f"{block} missing from the hash map"
    for block_hash, block in cached.items():
        assert block.block_hash == block_hash, (
            f"hash map entry {block_hash.hex()} points to {block}")


def assert_tiers_clean(tiers: KVTiers) -> None:
    """The device pool clean, and the host (and disk) tier with no copy pending and
    consistent slots."""
    assert_pool_clean(tiers.pool)
    pending = tiers.take_copies()
    assert not pending, f"tier copies still queued: {pending}"
    host = tiers.host
    assert host.num_pinned == 0, f"{host.num_pinned} host slots still pinned"
    slots = [host.lookup(h) for h in host.cached_hashes()]
    assert len(set(slots)) == len(slots), f"two host blocks share a slot: {slots}"
    assert host.num_cached + host.num_free == host.num_slots, (
        f"{host.num_cached} cached + {host.num_free} free != {host.num_slots} host slots")
    disk = tiers.disk
    if disk is not None:  # only writes still in flight may pin a disk slot
        assert disk.num_pinned == tiers.num_pending_spills, (
            f"{disk.num_pinned} disk slots pinned, {tiers.num_pending_spills} writes pending")
        slots = [disk.lookup(h) for h in disk.cached_hashes()]
        assert len(set(slots)) == len(slots), f"two disk blocks share a slot: {slots}"
        assert disk.num_cached + disk.num_free == disk.num_slots, (
            f"{disk.num_cached} cached + {disk.num_free} free != {disk.num_slots} disk slots")


def _assert_links_consistent(free: list) -> None:
    # get_all_free_blocks walks next pointers only; check the prev pointers agree.
    for prev_block, block in itertools.pairwise(free):
        assert block.prev_free is prev_block, f"broken prev link at {block}"


def count_calls(monkeypatch, module, name: str) -> list:
    """Wrap `module.name` so every call still runs it and appends its arguments to the
    returned list: proof that a code path was taken (e.g. an optimised one)."""
    calls: list = []
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls
