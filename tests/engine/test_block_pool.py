"""Tests of the block pool: LRU eviction, prefix hits, caching rules, events, leak checks."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pdcluster.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from pdcluster.core.hashing import hash_block_tokens
from pdcluster.engine.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from tests.helpers import assert_pool_clean

BLOCK_SIZE = 4


def make_pool(num_blocks: int = 8, **kwargs: bool) -> BlockPool:
    kwargs.setdefault("enable_events", True)
    return BlockPool(num_blocks, BLOCK_SIZE, **kwargs)


def make_hashes(n: int, first_token: int = 0) -> list[bytes]:
    """A hash chain of n blocks (one token per block keeps the chains easy to vary)."""
    return hash_block_tokens(list(range(first_token, first_token + n)), 1)


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def allocate_cached(pool: BlockPool, hashes: list[bytes]) -> list[KVCacheBlock]:
    blocks = pool.get_new_blocks(len(hashes))
    pool.cache_blocks(blocks, hashes, None)
    return blocks


def test_new_pool_is_clean() -> None:
    pool = make_pool()
    assert pool.num_free_blocks == 8 and pool.usage == 0.0
    assert ids(pool.free_block_queue.get_all_free_blocks()) == list(range(8))
    assert_pool_clean(pool)


def test_get_new_blocks_takes_references() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(2)
    assert ids(blocks) == [0, 1]
    assert [block.ref_cnt for block in blocks] == [1, 1]
    assert pool.num_free_blocks == 6 and pool.usage == 0.25
    assert pool.get_new_blocks(0) == []
    pool.free_blocks(blocks)
    assert_pool_clean(pool)


def test_lru_freed_earliest_is_evicted_first() -> None:
    pool = make_pool(num_blocks=6)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks([blocks[2]])
    pool.free_blocks([blocks[0]])
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 5, 2, 0]
    assert ids(pool.get_new_blocks(3)) == [4, 5, 2]


def test_reverse_free_evicts_chain_tail_first() -> None:
    pool = make_pool(num_blocks=3)
    hashes = make_hashes(3)
    blocks = allocate_cached(pool, hashes)
    pool.free_blocks(reversed(blocks))
    assert pool.get_new_blocks(1) == [blocks[2]]
    assert pool.find_longest_prefix(hashes) == blocks[:2]


def test_eviction_removes_hash_and_records_one_event() -> None:
    pool = make_pool(num_blocks=3)
    hashes = make_hashes(3)
    blocks = allocate_cached(pool, hashes)
    assert pool.take_events() == [BlockStored(tuple(hashes), None, BLOCK_SIZE)]
    pool.free_blocks(reversed(blocks))
    reused = pool.get_new_blocks(2)
    assert reused == [blocks[2], blocks[1]]
    assert pool.take_events() == [BlockRemoved((hashes[2], hashes[1]))]
    assert all(block.block_hash is None for block in reused)
    assert pool.get_cached_block(hashes[2]) is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert set(pool.cached_block_map) == {hashes[0]}


def test_hit_on_cached_free_block_leaves_free_queue() -> None:
    pool = make_pool(num_blocks=4)
    hashes = make_hashes(2)
    blocks = allocate_cached(pool, hashes)
    pool.free_blocks(reversed(blocks))
    hits = pool.find_longest_prefix(hashes)
    assert hits == blocks and pool.num_free_blocks == 4
    pool.touch(hits)
    assert pool.num_free_blocks == 2 and [b.ref_cnt for b in blocks] == [1, 1]
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [2, 3]
    pool.touch(hits[:1])  # a second request sharing a block in use
    assert blocks[0].ref_cnt == 2 and pool.num_free_blocks == 2
    assert pool.get_new_blocks(2) == pool.blocks[2:]
    assert pool.take_events() == [BlockStored(tuple(hashes), None, BLOCK_SIZE)]


def test_find_longest_prefix_stops_at_first_miss() -> None:
    pool = make_pool()
    hashes = make_hashes(4)
    held = allocate_cached(pool, hashes[:2])
    lone = pool.get_new_blocks(1)
    pool.cache_blocks(lone, hashes[3:], hashes[2])
    assert pool.find_longest_prefix(hashes) == held
    assert pool.find_longest_prefix(hashes[2:]) == []
    assert [block.ref_cnt for block in held + lone] == [1, 1, 1]


def test_duplicate_hash_left_uncached() -> None:
    pool = make_pool()
    hashes = make_hashes(2)
    first = allocate_cached(pool, hashes)
    pool.take_events()
    second = pool.get_new_blocks(2)
    pool.cache_blocks(second, hashes, None)
    assert [block.block_hash for block in second] == [None, None]
    assert pool.find_longest_prefix(hashes) == first
    assert pool.take_events() == []
    pool.free_blocks(reversed(second))
    pool.free_blocks(reversed(first))
    assert_pool_clean(pool)


def test_stored_events_split_into_runs_with_parents() -> None:
    pool = make_pool()
    h = make_hashes(5)
    blocks = pool.get_new_blocks(5)
    other = pool.get_new_blocks(1)
    pool.cache_blocks(blocks[3:4], h[3:4], h[2])  # b3 already holds its own hash
    pool.cache_blocks(other, h[1:2], h[0])  # h1 already cached by another block
    assert pool.take_events() == [BlockStored((h[3],), h[2], BLOCK_SIZE),
                                  BlockStored((h[1],), h[0], BLOCK_SIZE)]
    pool.cache_blocks(blocks, h, None)
    assert pool.take_events() == [
        BlockStored((h[0],), None, BLOCK_SIZE),
        BlockStored((h[2],), h[1], BLOCK_SIZE),
        BlockStored((h[4],), h[3], BLOCK_SIZE),
    ]
    assert blocks[1].block_hash is None and other[0].block_hash == h[1]


def test_cache_blocks_continuing_a_chain_uses_given_parent() -> None:
    pool = make_pool()
    h = make_hashes(4)
    blocks = allocate_cached(pool, h[:2])
    blocks += pool.get_new_blocks(2)
    pool.take_events()
    pool.cache_blocks(blocks[2:], h[2:], h[1])
    pool.cache_blocks(blocks, h, None)  # already cached: a no-op
    assert pool.take_events() == [BlockStored((h[2], h[3]), h[1], BLOCK_SIZE)]


def test_cache_blocks_with_a_different_hash_is_a_bug() -> None:
    pool = make_pool()
    blocks = allocate_cached(pool, make_hashes(1))
    with pytest.raises(AssertionError, match="another hash"):
        pool.cache_blocks(blocks, make_hashes(1, first_token=7), None)


def test_caching_disabled() -> None:
    pool = make_pool(enable_caching=False)
    hashes = make_hashes(2)
    blocks = allocate_cached(pool, hashes)
    assert [block.block_hash for block in blocks] == [None, None]
    assert pool.find_longest_prefix(hashes) == []
    assert pool.take_events() == []


def test_events_not_recorded_unless_enabled() -> None:
    pool = make_pool(num_blocks=2, enable_events=False)
    pool.free_blocks(allocate_cached(pool, make_hashes(2)))
    pool.get_new_blocks(2)
    pool.free_blocks(pool.blocks)
    assert pool.reset_prefix_cache()
    assert pool.take_events() == []


def test_take_events_drains() -> None:
    pool = make_pool()
    allocate_cached(pool, make_hashes(1))
    assert len(pool.take_events()) == 1
    assert pool.take_events() == []


def test_reset_prefix_cache() -> None:
    pool = make_pool()
    hashes = make_hashes(3)
    blocks = allocate_cached(pool, hashes)
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert pool.find_longest_prefix(hashes) == blocks and pool.take_events() == []
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.find_longest_prefix(hashes) == [] and not pool.cached_block_map
    assert all(block.block_hash is None for block in pool.blocks)
    assert pool.take_events() == [AllBlocksCleared()]
    assert_pool_clean(pool)


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0), (-1, 1)])
def test_invalid_pool_arguments(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockPool(num_blocks, block_size)


def test_allocation_errors_change_nothing() -> None:
    pool = make_pool(num_blocks=2)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.get_new_blocks(3)
    with pytest.raises(ValueError):
        pool.get_new_blocks(-1)
    assert_pool_clean(pool)


def test_misuse_is_caught() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="2 blocks but 1 hashes"):
        pool.cache_blocks(blocks, make_hashes(1), None)
    pool.free_blocks(blocks)
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks(blocks[:1])
    with pytest.raises(IndexError):
        FreeBlockQueue([]).popleft()


def test_block_identity_and_repr() -> None:
    pool = make_pool(num_blocks=3)
    assert KVCacheBlock(1) != KVCacheBlock(1)
    assert "prev_free=0, next_free=2" in repr(pool.blocks[1])


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / cache / hit / free / reset sequences against a plain-Python model.

    The model keeps the LRU free list, ref counts, each block's hash and the hash map; after
    every step the pool must agree with it exactly, events included.
    """

    @initialize(num_blocks=st.integers(min_value=1, max_value=8))
    def make(self, num_blocks: int) -> None:
        self.pool = make_pool(num_blocks=num_blocks)
        self.free = list(range(num_blocks))
        self.refs = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.requests: list[tuple[list[KVCacheBlock], list[bytes]]] = []

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=4), partial=st.booleans())
    def allocate(self, prompt: list[int], partial: bool) -> None:
        hashes = hash_block_tokens(prompt, 1)  # few distinct tokens: prefixes get shared
        hits = self.pool.find_longest_prefix(hashes)
        expected_hits = []
        for block_hash in hashes:
            if block_hash not in self.cached:
                break
            expected_hits.append(self.cached[block_hash])
        assert ids(hits) == expected_hits
        num_new = len(hashes) - len(hits) + partial
        if num_new > len(self.free) - sum(self.refs[i] == 0 for i in expected_hits):
            return
        self.pool.touch(hits)
        for block_id in expected_hits:
            if self.refs[block_id] == 0:
                self.free.remove(block_id)
            self.refs[block_id] += 1
        new_blocks = self.pool.get_new_blocks(num_new)
        assert ids(new_blocks) == self.free[:num_new]
        evicted = [self._evict(block_id) for block_id in self.free[:num_new]]
        del self.free[:num_new]
        evicted = [block_hash for block_hash in evicted if block_hash is not None]
        assert self.pool.take_events() == ([BlockRemoved(tuple(evicted))] if evicted else [])
        self.requests.append((hits + new_blocks, hashes))

    def _evict(self, block_id: int) -> bytes | None:
        block_hash, self.hash_of[block_id] = self.hash_of[block_id], None
        if block_hash is not None:
            del self.cached[block_hash]
        self.refs[block_id] = 1
        return block_hash

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        blocks, hashes = data.draw(st.sampled_from(self.requests))
        self.pool.cache_blocks(blocks[:len(hashes)], hashes, None)
        stored = []
        for block, block_hash in zip(blocks, hashes, strict=False):
            if self.hash_of[block.block_id] is None and block_hash not in self.cached:
                self.hash_of[block.block_id] = block_hash
                self.cached[block_hash] = block.block_id
                stored.append(block_hash)
        events = self.pool.take_events()
        assert [h for event in events for h in event.block_hashes] == stored
        for event in events:
            first = hashes.index(event.block_hashes[0])
            assert event.parent_hash == (hashes[first - 1] if first else None)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free_request(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.requests) - 1))
        blocks, _ = self.requests.pop(index)
        self.pool.free_blocks(reversed(blocks))
        for block in reversed(blocks):
            self.refs[block.block_id] -= 1
            if self.refs[block.block_id] == 0:
                self.free.append(block.block_id)
        assert self.pool.take_events() == []

    @rule()
    def reset(self) -> None:
        done = self.pool.reset_prefix_cache()
        assert done == (not self.requests)
        if done:
            self.hash_of = [None] * len(self.hash_of)
            self.cached.clear()
        assert self.pool.take_events() == ([AllBlocksCleared()] if done else [])

    @invariant()
    def pool_matches_model(self) -> None:
        assert [block.ref_cnt for block in self.pool.blocks] == self.refs
        assert [block.block_hash for block in self.pool.blocks] == self.hash_of
        assert ids(self.pool.free_block_queue.get_all_free_blocks()) == self.free
        assert self.pool.num_free_blocks == len(self.free)
        assert {h: b.block_id for h, b in self.pool.cached_block_map.items()} == self.cached

    def teardown(self) -> None:
        for blocks, _ in self.requests:
            self.pool.free_blocks(reversed(blocks))
        assert_pool_clean(self.pool)


BlockPoolMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None)
test_block_pool_state_machine = BlockPoolMachine.TestCase
