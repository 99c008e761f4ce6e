"""The host tier's bookkeeping (torch-free): demotion on eviction, lookups through both tiers,
load-back, the host's LRU and pins, the events the global index gets, and leak checks on both
pools after every scenario."""

from __future__ import annotations

import random

import pytest

from pdcluster.core.block_index import BlockIndex, apply_events
from pdcluster.core.events import DEVICE, HOST, BlockMoved, BlockRemoved, BlockStored
from pdcluster.engine.core.block_pool import BlockPool
from pdcluster.engine.core.host_pool import HostBlockPool
from pdcluster.engine.core.kv_cache_manager import KVCacheManager
from pdcluster.engine.core.kv_tiers import HostHit, KVTiers
from pdcluster.engine.kv.host_kv_cache import copy_runs
from tests.engine.test_kv_cache_manager import BLOCK_SIZE, make_request
from tests.helpers import assert_pool_clean, assert_tiers_clean


def make_tiered(num_blocks: int = 4, num_host: int = 8
                ) -> tuple[KVCacheManager, BlockPool, KVTiers]:
    pool = BlockPool(num_blocks, BLOCK_SIZE, enable_events=True)
    tiers = KVTiers(pool, HostBlockPool(num_host))
    return KVCacheManager(pool, True, tiers), pool, tiers


def run(kv: KVCacheManager, req) -> list:
    """Admit, compute and free `req` as the scheduler would; returns its prefix hits, then
    runs the step's copies (as the engine does before the model)."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    kv.tiers.copies_done(kv.tiers.take_copies())
    kv.free(req)
    return hits


def test_evicted_blocks_are_demoted_to_the_host_tail_first() -> None:
    kv, pool, tiers = make_tiered()
    a = make_request("a", 3 * BLOCK_SIZE + 1)  # 3 full blocks + 1 token: 4 blocks
    run(kv, a)
    pool.take_events()
    run(kv, make_request("b", 3 * BLOCK_SIZE + 1))  # needs every block: a's 3 hashes go
    copies_before = tiers.num_demoted
    events = pool.take_events()
    assert events[0] == BlockMoved(tuple(reversed(a.block_hashes[:3])), DEVICE, HOST)
    assert isinstance(events[1], BlockStored)
    assert copies_before == 3
    assert tiers.host.cached_hashes() == list(reversed(a.block_hashes[:3]))
    assert_tiers_clean(tiers)


def test_a_host_hit_is_loaded_back_and_keeps_its_host_copy() -> None:
    kv, pool, tiers = make_tiered()
    prompt = make_request("a", 3 * BLOCK_SIZE + 1).prompt_token_ids
    run(kv, make_request("a", prompt=prompt))
    run(kv, make_request("b", 3 * BLOCK_SIZE + 1))  # demotes a's blocks
    pool.take_events()
    again = make_request("a2", prompt=prompt)
    hits, num_hit = kv.get_computed_blocks(again)
    assert [type(h) for h in hits] == [HostHit] * 3 and num_hit == 3 * BLOCK_SIZE
    assert kv.allocate_slots(again, 1, hits) is not None
    copies = tiers.take_copies()
    # b's blocks were demoted to make room: 3 copies out, 3 in, every slot pinned till done
    assert len(copies.loads) == 3 and len(copies.demotions) == 3
    assert tiers.host.num_pinned == 6
    assert len(copy_runs(copies.loads)) == 1  # a chain comes back in one copy
    events = pool.take_events()
    # b's blocks make room (demoted), then a's come back onto the device as one chain
    assert BlockStored(tuple(again.block_hashes[:3]), None, BLOCK_SIZE) in events
    tiers.copies_done(copies)
    kv.free(again)
    # demoting a's blocks again copies nothing: the host still has them
    num_demoted = tiers.num_demoted
    run(kv, make_request("c", 3 * BLOCK_SIZE + 1))
    removed = [e for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved(tuple(reversed(again.block_hashes[:3])), DEVICE)]
    assert tiers.num_demoted == num_demoted
    assert_tiers_clean(tiers)


def test_the_host_evicts_its_least_recently_used_block() -> None:
    kv, pool, tiers = make_tiered(num_blocks=2, num_host=2)
    first = make_request("a", BLOCK_SIZE + 1)
    run(kv, first)
    run(kv, make_request("b", BLOCK_SIZE + 1))  # a0 -> host
    run(kv, make_request("c", BLOCK_SIZE + 1))  # b0 -> host
    assert tiers.host.cached_hashes() == [first.block_hashes[0], pool_hash_of(tiers, 1)]
    pool.take_events()
    run(kv, make_request("d", BLOCK_SIZE + 1))  # c0 -> host; a0, the oldest, goes
    events = pool.take_events()
    assert BlockRemoved((first.block_hashes[0],), HOST) in events
    assert first.block_hashes[0] not in tiers.host.cached_hashes()
    assert tiers.num_host_evicted == 1
    assert_tiers_clean(tiers)


def pool_hash_of(tiers: KVTiers, position: int) -> bytes:
    return tiers.host.cached_hashes()[position]


def test_a_pinned_host_slot_is_never_evicted() -> None:
    kv, pool, tiers = make_tiered(num_blocks=3, num_host=1)
    prompt = make_request("a", BLOCK_SIZE + 1).prompt_token_ids
    run(kv, make_request("a", prompt=prompt))
    run(kv, make_request("b", 2 * BLOCK_SIZE + 1))  # a0 demoted into the only host slot
    again = make_request("a2", prompt=prompt)
    hits, _ = kv.get_computed_blocks(again)
    assert isinstance(hits[0], HostHit)
    pool.take_events()
    # loading a0 needs a device block: evicting b's cached blocks to make room would demote
    # them, but the one host slot is pinned by the load, so they are dropped instead
    assert kv.allocate_slots(again, 1, hits) is not None
    events = pool.take_events()
    assert any(isinstance(e, BlockRemoved) and e.medium == DEVICE for e in events)
    assert not any(isinstance(e, BlockMoved) for e in events)
    tiers.copies_done(tiers.take_copies())
    kv.free(again)
    assert_tiers_clean(tiers)


def test_a_burst_larger_than_the_host_keeps_the_chain_heads() -> None:
    kv, pool, tiers = make_tiered(num_blocks=4, num_host=2)
    a = make_request("a", 3 * BLOCK_SIZE + 1)
    run(kv, a)
    pool.take_events()
    run(kv, make_request("b", 3 * BLOCK_SIZE + 1))  # a's 3 hashes go at once, 2 host slots
    assert sorted(tiers.host.cached_hashes()) == sorted(a.block_hashes[:2])
    assert BlockRemoved((a.block_hashes[2],), DEVICE) in pool.take_events()
    hits, num_hit = kv.get_computed_blocks(make_request("a2", prompt=a.prompt_token_ids))
    assert [type(h) for h in hits] == [HostHit, HostHit] and num_hit == 2 * BLOCK_SIZE
    assert_tiers_clean(tiers)


def test_a_chain_through_both_tiers() -> None:
    kv, pool, tiers = make_tiered(num_blocks=4, num_host=8)
    prompt = make_request("a", 3 * BLOCK_SIZE + 1).prompt_token_ids
    run(kv, make_request("a", prompt=prompt))
    run(kv, make_request("b", 2 * BLOCK_SIZE + 1))  # 3 blocks: a3 (unhashed), a2, a1 go
    hits, num_hit = kv.get_computed_blocks(make_request("a2", prompt=prompt))
    assert [type(h).__name__ for h in hits] == ["KVCacheBlock", "HostHit", "HostHit"]
    assert num_hit == 3 * BLOCK_SIZE
    assert_tiers_clean(tiers)


def test_reset_clears_both_tiers() -> None:
    kv, pool, tiers = make_tiered()
    run(kv, make_request("a", 3 * BLOCK_SIZE + 1))
    run(kv, make_request("b", 3 * BLOCK_SIZE + 1))
    assert tiers.host.num_cached == 3
    assert tiers.reset()
    assert tiers.host.num_cached == 0 and not pool.cached_block_map
    assert tiers.cached_hashes() == []


def test_host_pool_refuses_bad_sizes_and_double_unpins() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        HostBlockPool(0)
    host = HostBlockPool(1)
    slot, _ = host.allocate(b"x" * 32)
    host.pin(slot)
    assert host.allocate(b"y" * 32) == (None, [])  # the only slot is pinned
    assert not host.clear()
    host.unpin(slot)
    with pytest.raises(AssertionError):
        host.unpin(slot)


@pytest.mark.parametrize("seed", range(6))
def test_index_fed_by_the_events_matches_both_tiers(seed: int) -> None:
    """Random requests over a small device pool and a smaller host: the index built from the
    events holds exactly the blocks of either tier, each on its media."""
    rng = random.Random(seed)
    kv, pool, tiers = make_tiered(num_blocks=6, num_host=5)
    index = BlockIndex()
    index.add_node("n")
    prompts = [make_request(f"p{i}", rng.randint(1, 4) * BLOCK_SIZE + 1).prompt_token_ids
               for i in range(5)]
    for step in range(60):
        base = rng.choice(prompts)
        prompt = base[:rng.randint(1, len(base))] + ([rng.randint(5, 9)] if rng.random() < 0.3
                                                     else [])
        run(kv, make_request(f"r{step}", prompt=prompt))
        apply_events(index, "n", pool.take_events())
        device = set(pool.cached_block_map)
        host = set(tiers.host.cached_hashes())
        assert index.node_blocks("n") == device | host
        media = index.node_media("n")
        for block_hash in device | host:
            mask = (1 if block_hash in device else 0) | (2 if block_hash in host else 0)
            assert media.get(block_hash, 1) == mask
        index.check_invariants()
    assert_tiers_clean(tiers)
    assert_pool_clean(pool)


def test_copy_runs_merge_consecutive_blocks_either_way() -> None:
    assert copy_runs([(0, 5), (1, 6), (2, 7), (9, 1)]) == [(0, 5, 3), (9, 1, 1)]
    assert copy_runs([(2, 7), (1, 6), (0, 5)]) == [(0, 5, 3)]
    assert copy_runs([(0, 5), (1, 6), (0, 5)]) == [(0, 5, 2), (0, 5, 1)]
    assert copy_runs([(3, 3), (2, 4)]) == [(3, 3, 1), (2, 4, 1)]
    assert copy_runs([]) == []
