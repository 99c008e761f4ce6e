"""The scheduler's half of global prefix reuse, torch-free: the production connector
scheduler plans the pulls, and the test plays the worker by feeding `ConnectorResults`. Every
scenario ends with a leak check of the pool."""

from __future__ import annotations

import pytest

from pdcluster.core.kv_connector import ConnectorResults, PrefixTokens, PullLookup, PullResult
from pdcluster.core.kv_transfer import PrefixPull, RemoteDecode
from pdcluster.engine.core.block_pool import BlockPool
from pdcluster.engine.core.kv_cache_manager import KVCacheManager
from pdcluster.engine.core.prefix_pulls import _Lookup
from pdcluster.engine.core.request import RequestStatus
from pdcluster.engine.core.scheduler import Scheduler, SchedulerConfig
from pdcluster.transfer.connector_scheduler import ConnectorScheduler
from tests.engine.test_kv_cache_manager import BLOCK_SIZE, make_request
from tests.engine.test_scheduler import run_all, step
from tests.helpers import assert_pool_clean

HOLDER = "tcp://holder:1"


def make_scheduler(min_pull_blocks: int = 2, num_blocks: int = 32):
    pool = BlockPool(num_blocks, BLOCK_SIZE)
    connector = ConnectorScheduler(min_pull_blocks=min_pull_blocks)
    sched = Scheduler(SchedulerConfig(64, 8, 256), KVCacheManager(pool), connector)
    return sched, pool, connector


def pulling(prompt_len: int, num_blocks: int, request_id: str = "r", **kw):
    req = make_request(request_id, prompt_len, **kw)
    req.prefix_pull = PrefixPull(HOLDER, num_blocks)
    return req


def test_pull_parks_the_request_and_names_blocks_by_tokens_and_salt():
    sched, pool, connector = make_scheduler()
    req = pulling(22, 5, cache_salt="tenant-a")  # 5 full blocks before the last token's
    sched.add_request(req)
    assert step(sched).chunks == []  # parked: no compute this step
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    (job,) = connector.build_plan().pulls
    assert job.source_addr == HOLDER
    assert job.prefix == PrefixTokens(req.prompt_token_ids[:20], BLOCK_SIZE, 0, "tenant-a")
    assert job.block_ids == sched.kv.block_ids("r")
    assert not pool.cached_block_map  # nothing hashed before the bytes arrive
    sched.apply_connector_results(ConnectorResults(pulled=[PullResult("r", True, 5)]))
    assert req.num_computed_tokens == req.num_cached_tokens == 20 and req.prefix_pull is None
    assert len(pool.cached_block_map) == 5
    (chunk,) = step(sched).chunks
    assert (chunk.start, chunk.num_tokens, chunk.samples) == (20, 2, True)
    run_all(sched)
    assert_pool_clean(pool)


def test_partial_or_failed_pull_computes_the_rest():
    sched, pool, connector = make_scheduler()
    partial, failed = pulling(22, 5, "partial"), pulling(22, 5, "failed")
    for req in (partial, failed):
        sched.add_request(req)
    step(sched)
    results = ConnectorResults(pulled=[PullResult("partial", True, 2),
                                       PullResult("failed", False, 5, "holder gone")])
    sched.apply_connector_results(results)
    assert partial.num_computed_tokens == 8 and failed.num_computed_tokens == 0
    chunks = {c.request_id: (c.start, c.num_tokens) for c in step(sched).chunks}
    assert chunks == {"partial": (8, 14), "failed": (0, 22)}
    run_all(sched)
    assert partial.status is failed.status is RequestStatus.FINISHED_LENGTH
    assert_pool_clean(pool)


@pytest.mark.parametrize("hint_blocks, min_pull_blocks", [(1, 2), (3, 4), (9, 1)])
def test_threshold_and_last_block(hint_blocks, min_pull_blocks):
    sched, pool, connector = make_scheduler(min_pull_blocks)
    req = pulling(12, hint_blocks)  # 3 blocks: only 2 may be pulled
    sched.add_request(req)
    step(sched)
    pulls = connector.build_plan().pulls
    if min_pull_blocks <= min(hint_blocks, 2):
        assert len(pulls[0].block_ids) == 2
        sched.apply_connector_results(ConnectorResults(pulled=[PullResult("r", True, 2)]))
    else:
        assert not pulls and req.status is RequestStatus.RUNNING
    run_all(sched)
    assert_pool_clean(pool)


def test_abort_while_pulling_pins_until_the_result():
    sched, pool, connector = make_scheduler()
    req = pulling(22, 5, max_tokens=1)
    req.kv_transfer = RemoteDecode("t-d")  # also cancelled, so D hears of it
    sched.add_request(req)
    step(sched)
    (job,) = connector.build_plan().pulls
    sched.finish_request("r", RequestStatus.FINISHED_ABORTED)
    assert "r" in sched.pinned
    assert sorted(connector.build_plan().cancelled) == sorted([job.transfer_id, "t-d"])
    sched.apply_connector_results(ConnectorResults(pulled=[PullResult("r", False, 0, "x")]))
    assert not sched.pinned
    assert_pool_clean(pool)


def test_holder_references_the_leading_run_until_served():
    sched, pool, connector = make_scheduler()
    held = make_request("h", 22)
    sched.add_request(held)
    run_all(sched)
    cached = list(pool.cached_block_map)
    tokens = list(held.prompt_token_ids[:20])
    tokens[13] += 1  # block 3 differs: a miss after three hits
    lookup = PullLookup("pull-1", PrefixTokens(tokens, BLOCK_SIZE, 0))
    sched.apply_connector_results(ConnectorResults(lookups=[lookup]))
    (serve,) = connector.build_plan().serves
    assert serve.block_ids == [pool.get_cached_block(h).block_id for h in cached[:3]]
    assert all(pool.get_cached_block(h).ref_cnt == 1 for h in cached[:3])
    sched.apply_connector_results(ConnectorResults(lookups=[lookup]))  # a duplicate
    assert not connector.build_plan().serves
    sched.apply_connector_results(ConnectorResults(served=["pull-1"]))
    assert not sched.pulls.serving
    assert_pool_clean(pool)


@pytest.mark.parametrize("salt, block_size, expect_blocks", [
    ("tenant-a", BLOCK_SIZE, 4),  # the owner's salt: served
    (None, BLOCK_SIZE, 0),  # the same tokens without the salt: nothing
    ("tenant-b", BLOCK_SIZE, 0),  # another tenant's salt: nothing
    ("tenant-a", 2 * BLOCK_SIZE, 0),  # another block size names other blocks
])
def test_holder_honours_the_cache_salt(salt, block_size, expect_blocks):
    """A pull names blocks by tokens + salt and the holder hashes them itself, so knowing a
    salted tenant's block hashes (visible in the index) or its prompt opens nothing."""
    sched, pool, connector = make_scheduler()
    held = make_request("h", 22, cache_salt="tenant-a")
    sched.add_request(held)
    run_all(sched)
    prefix = PrefixTokens(list(held.prompt_token_ids[:16]), block_size, 0, salt)
    sched.apply_connector_results(ConnectorResults(lookups=[PullLookup("pull-1", prefix)]))
    (serve,) = connector.build_plan().serves
    assert len(serve.block_ids) == expect_blocks
    sched.apply_connector_results(ConnectorResults(served=["pull-1"]))
    assert_pool_clean(pool)


def test_a_huge_lookup_is_hashed_a_bounded_slice_per_step():
    """A peer naming 64 blocks costs at most `max_hash_blocks_per_step` hashes per step; the
    lookup resolves over several steps, and stops at the first block this node lacks."""
    sched, pool, connector = make_scheduler(num_blocks=16)
    held = make_request("h", 22)
    sched.add_request(held)
    run_all(sched)
    sched.pulls.max_hash_blocks_per_step = 2
    tokens = list(held.prompt_token_ids[:20]) + [7] * (60 * BLOCK_SIZE)
    lookup = PullLookup("pull-1", PrefixTokens(tokens, BLOCK_SIZE, 0))
    sched.apply_connector_results(ConnectorResults(lookups=[lookup]))
    assert len(sched.pulls.pending["pull-1"].hashes) == 2 and sched.pulls.pending
    assert not connector.build_plan().serves  # not resolved yet: the engine steps on
    steps = 1
    while sched.pulls.pending:
        sched.apply_connector_results(ConnectorResults())
        steps += 1
    (serve,) = connector.build_plan().serves
    assert len(serve.block_ids) == 5 and steps == 3  # 6 blocks hashed: 5 hits, then a miss
    sched.apply_connector_results(ConnectorResults(served=["pull-1"]))
    assert_pool_clean(pool)


def test_a_lookup_never_hashes_past_what_the_pool_could_hold():
    sched, pool, connector = make_scheduler(num_blocks=16)
    hashed: list[int] = []
    advance = _Lookup.advance

    def counting(self, budget, kv):
        hashed.append(advance(self, budget, kv))
        return hashed[-1]

    prefix = PrefixTokens([1] * (1000 * BLOCK_SIZE), BLOCK_SIZE, 100)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_Lookup, "advance", counting)
        sched.apply_connector_results(ConnectorResults(lookups=[PullLookup("pull-1", prefix)]))
    assert sum(hashed) == 100 + 16  # the requester's own blocks, then at most a pool's worth
    (serve,) = connector.build_plan().serves
    assert serve.block_ids == []
    sched.apply_connector_results(ConnectorResults(served=["pull-1"]))
    assert_pool_clean(pool)


def test_a_lookup_released_while_being_hashed_references_nothing():
    sched, pool, connector = make_scheduler()
    sched.pulls.max_hash_blocks_per_step = 1
    prefix = PrefixTokens([1] * (8 * BLOCK_SIZE), BLOCK_SIZE, 0)
    sched.apply_connector_results(ConnectorResults(lookups=[PullLookup("pull-1", prefix)]))
    sched.apply_connector_results(ConnectorResults(served=["pull-1"]))  # expired meanwhile
    assert not sched.pulls.pending and not sched.pulls.serving
    assert sched.pins.num_used == 0
    assert_pool_clean(pool)
