"""Tests of the per-request block tables: prefix hits, allocation, incremental hashing, freeing.

Torch-free bookkeeping only. The factories here (`make_request`, `make_manager`) are shared
with the scheduler tests.
"""

from __future__ import annotations

import itertools

import pytest

from pdcluster.core.events import BlockRemoved, BlockStored
from pdcluster.core.hashing import BlockExtra, hash_block_tokens
from pdcluster.engine.core.block_pool import BlockPool
from pdcluster.engine.core.kv_cache_manager import KVCacheManager
from pdcluster.engine.core.request import Request
from pdcluster.engine.core.sampling_params import SamplingParams
from tests.helpers import assert_pool_clean

BLOCK_SIZE = 4
EOS = 2
_next_token = itertools.count(1000)  # globally unique prompt tokens: no accidental prefix hits
_next_arrival = itertools.count()  # an injected clock: arrival order == creation order


def make_request(request_id: str, prompt_len: int | None = None, max_tokens: int = 4,
                 block_size: int = BLOCK_SIZE, *, prompt: list[int] | None = None,
                 cache_salt: str | None = None, arrival_time: float | None = None,
                 **params) -> Request:
    """A request with a fresh prompt of `prompt_len` tokens (or exactly `prompt`)."""
    if prompt is None:
        assert prompt_len is not None, "give prompt_len or prompt"
        prompt = [next(_next_token) for _ in range(prompt_len)]
    extra = BlockExtra(cache_salt=cache_salt) if cache_salt else None
    arrival = float(next(_next_arrival)) if arrival_time is None else arrival_time
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params),
                   block_size, eos_token_ids=(EOS,), extra=extra, arrival_time=arrival)


def make_manager(num_blocks: int = 8, enable_caching: bool = True,
                 enable_events: bool = False) -> tuple[KVCacheManager, BlockPool]:
    pool = BlockPool(num_blocks, BLOCK_SIZE, enable_caching=enable_caching,
                     enable_events=enable_events)
    return KVCacheManager(pool, enable_caching), pool


def prefill(kv: KVCacheManager, req: Request) -> None:
    """Admit `req` the way the scheduler does: prefix hit, then the whole rest in one chunk."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens


def compute(kv: KVCacheManager, req: Request, num_tokens: int) -> None:
    """One scheduled chunk of `num_tokens` for a running request."""
    assert kv.allocate_slots(req, num_tokens) is not None
    req.num_computed_tokens += num_tokens


@pytest.mark.parametrize("prompt_len, expected_hit", [(3, 0), (4, 0), (8, 4), (9, 8), (12, 8)])
def test_prefix_hit_always_leaves_a_token_to_compute(prompt_len, expected_hit) -> None:
    kv, pool = make_manager()
    first = make_request("a", prompt_len)
    prefill(kv, first)
    kv.free(first)
    again = make_request("b", prompt=first.prompt_token_ids)
    hits, num_hit = kv.get_computed_blocks(again)
    assert num_hit == expected_hit and len(hits) == expected_hit // BLOCK_SIZE
    assert num_hit < again.num_tokens
    assert [b.ref_cnt for b in hits] == [0] * len(hits), "lookup must not take references"
    assert_pool_clean(pool)


def test_failed_allocation_changes_nothing() -> None:
    kv, pool = make_manager(num_blocks=3)
    first = make_request("a", 8)
    prefill(kv, first)
    kv.free(first)  # 2 cached free blocks + 1 empty one
    big = make_request("b", prompt=first.prompt_token_ids + [7] * 9)  # hits 2, needs 3 more
    hits, num_hit = kv.get_computed_blocks(big)
    assert num_hit == 8
    free_before = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert kv.allocate_slots(big, big.num_tokens - num_hit, hits) is None
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == free_before
    assert [b.ref_cnt for b in hits] == [0, 0] and kv.block_ids("b") == []
    assert "b" not in kv.req_blocks
    assert_pool_clean(pool)


def test_free_hit_blocks_count_against_free_space() -> None:
    kv, pool = make_manager(num_blocks=3)
    first = make_request("a", 8)
    prefill(kv, first)
    first_ids = kv.block_ids("a")
    kv.free(first)
    fits = make_request("b", prompt=first.prompt_token_ids + [7] * 4)  # hits 2, needs 1 more
    prefill(kv, fits)
    assert kv.block_ids("b")[:2] == first_ids and pool.num_free_blocks == 0
    assert [b.ref_cnt for b in kv.req_blocks["b"]] == [1, 1, 1]
    kv.free(fits)
    assert_pool_clean(pool)


def test_blocks_are_hashed_as_chunks_fill_them() -> None:
    kv, pool = make_manager()
    req = make_request("a", 11)
    expected = hash_block_tokens(req.prompt_token_ids, BLOCK_SIZE)
    cached_after = []
    for chunk in (3, 3, 3, 2):  # chunk boundaries at 3, 6, 9: all mid-block
        assert kv.allocate_slots(req, chunk) is not None
        req.num_computed_tokens += chunk
        cached_after.append(set(pool.cached_block_map))
    assert cached_after == [set(), {expected[0]}, {expected[0], expected[1]},
                            {expected[0], expected[1]}]
    assert len(kv.block_ids("a")) == 3
    kv.free(req)
    assert_pool_clean(pool)


def test_generated_tokens_complete_and_hash_blocks() -> None:
    kv, pool = make_manager()
    req = make_request("a", 3)
    prefill(kv, req)
    for token in (50, 51, 52):  # decode: each step computes the token sampled before
        req.append_output_token(token)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
    # 6 tokens computed: block 0 = 3 prompt + 1 generated token is full and hashed.
    expected = hash_block_tokens(req.prompt_token_ids + [50], BLOCK_SIZE)
    assert set(pool.cached_block_map) == set(expected)
    assert pool.get_cached_block(expected[0]).block_id == kv.block_ids("a")[0]
    kv.free(req)
    assert_pool_clean(pool)


def test_decode_takes_one_new_block_per_block_size_tokens() -> None:
    kv, pool = make_manager()
    req = make_request("a", 4)
    prefill(kv, req)
    sizes = []
    for token in range(9):
        req.append_output_token(100 + token)
        new = kv.allocate_slots(req, 1)
        assert new is not None
        req.num_computed_tokens += 1
        sizes.append(len(new))
    # Token positions 4 and 8 and 12 start a new block.
    assert sizes == [1, 0, 0, 0, 1, 0, 0, 0, 1]
    kv.free(req)
    assert_pool_clean(pool)


def test_free_returns_blocks_tail_first() -> None:
    kv, pool = make_manager(num_blocks=6)
    req = make_request("a", 12)
    prefill(kv, req)
    block_ids = kv.block_ids("a")
    kv.free(req)
    kv.free(req)  # a second free is a no-op, not a double free
    free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert free_ids[-3:] == block_ids[::-1]
    assert kv.block_ids("a") == []
    assert_pool_clean(pool)


def test_caching_disabled_never_hits_nor_hashes() -> None:
    kv, pool = make_manager(enable_caching=False)
    first = make_request("a", 9)
    prefill(kv, first)
    kv.free(first)
    again = make_request("b", prompt=first.prompt_token_ids)
    assert kv.get_computed_blocks(again) == ([], 0)
    assert not pool.cached_block_map
    assert_pool_clean(pool)


def test_kv_events_chain_through_the_request() -> None:
    kv, pool = make_manager(num_blocks=4, enable_events=True)
    req = make_request("r", 10)
    events = []
    for chunk in (6, 4):  # chunked prefill, then 6 decode steps: 16 computed tokens
        compute(kv, req, chunk)
        events += pool.take_events()
    for token in range(6):
        req.append_output_token(50 + token)
        compute(kv, req, 1)
        events += pool.take_events()
    h = hash_block_tokens(req.all_token_ids, BLOCK_SIZE)
    assert events == [BlockStored((h[0],), None, BLOCK_SIZE),
                      BlockStored((h[1],), h[0], BLOCK_SIZE),
                      BlockStored((h[2],), h[1], BLOCK_SIZE),
                      BlockStored((h[3],), h[2], BLOCK_SIZE)]
    kv.free(req)
    follow = make_request("follow", prompt=req.prompt_token_ids[:4] + [7] * 6)
    prefill(kv, follow)  # hits block 0, takes 2 fresh blocks: the freed chain's tail goes
    g = hash_block_tokens(follow.prompt_token_ids, BLOCK_SIZE)
    assert g[0] == h[0]
    assert pool.take_events() == [BlockRemoved((h[3], h[2])),
                                  BlockStored((g[1],), h[0], BLOCK_SIZE)]
    kv.free(follow)
    assert pool.take_events() == []
    assert_pool_clean(pool)
