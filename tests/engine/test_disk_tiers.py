"""The disk tier's bookkeeping (torch-free): host evictions spilled to disk with one
`BlockMoved(host -> disk)`, a disk slot that is no hit until its write finished, the disk's
own LRU, dropped spills when too many writes are pending, failed writes forgotten, peers'
pull lookups that never claim a disk block, and the index fed by the events holding every
tier's blocks on their media; with tensor parallelism, a disk slot that is no hit until every
rank wrote its slice and pulls that claim host blocks as at one rank; leak checks on every pool
after each scenario."""

from __future__ import annotations

import random

from pdcluster.core.block_index import BlockIndex, apply_events
from pdcluster.core.events import DISK, HOST, BlockMoved, BlockRemoved
from pdcluster.engine.core.block_pool import BlockPool
from pdcluster.engine.core.host_pool import HostBlockPool
from pdcluster.engine.core.kv_cache_manager import KVCacheManager
from pdcluster.engine.core.kv_tiers import DiskHit, HostHit, KVTiers
from pdcluster.engine.kv.host_kv_cache import copy_runs
from tests.engine.test_kv_cache_manager import BLOCK_SIZE, make_request
from tests.helpers import assert_pool_clean, assert_tiers_clean


def make_tiered(num_blocks: int = 4, num_host: int = 2, num_disk: int = 8,
                max_pending: int = 64, num_ranks: int = 1
                ) -> tuple[KVCacheManager, BlockPool, KVTiers]:
    pool = BlockPool(num_blocks, BLOCK_SIZE, enable_events=True)
    tiers = KVTiers(pool, HostBlockPool(num_host), HostBlockPool(num_disk), max_pending,
                    num_ranks)
    return KVCacheManager(pool, True, tiers), pool, tiers


def run(kv: KVCacheManager, req, write: bool = True) -> list[int]:
    """Admit, compute and free `req` as the scheduler would, run the step's copies and
    (`write`) finish every disk write they queued; returns the disk slots whose writes are
    left pending."""
    tiers = kv.tiers
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    copies = tiers.take_copies()
    tiers.copies_done(copies)
    slots = [disk_slot for _, disk_slot in copies.spills]
    if write:
        tiers.writes_done([(slot, True) for slot in slots])
    kv.free(req)
    return [] if write else slots


def spilled_prompt(kv: KVCacheManager, num_blocks: int = 2, write: bool = True) -> list[int]:
    """A prompt of `num_blocks` full blocks pushed through the host down to the disk."""
    prompt = make_request("a", num_blocks * BLOCK_SIZE + 1).prompt_token_ids
    run(kv, make_request("a", prompt=prompt), write)
    for i in range(3):  # each fills the device: the host (2 slots) drops what came before
        run(kv, make_request(f"f{i}", 3 * BLOCK_SIZE + 1), write)
    return prompt


def test_host_evictions_move_to_the_disk_and_come_back() -> None:
    kv, pool, tiers = make_tiered()
    prompt = spilled_prompt(kv)
    events = pool.take_events()
    moved = [e for e in events if isinstance(e, BlockMoved) and e.dst == DISK]
    assert moved and all(e.src == HOST for e in moved)
    first = make_request("a", prompt=prompt).block_hashes[:2]
    assert set(first) <= set(tiers.disk.cached_hashes())
    again = make_request("a2", prompt=prompt)
    hits, num_hit = kv.get_computed_blocks(again)
    assert [type(h) for h in hits] == [DiskHit, DiskHit] and num_hit == 2 * BLOCK_SIZE
    assert kv.allocate_slots(again, 1, hits) is not None
    copies = tiers.take_copies()
    assert len(copies.disk_loads) == 2
    assert len(copy_runs(copies.disk_loads)) == 1  # one read for the chain
    assert tiers.disk.num_pinned == 2 + tiers.num_pending_spills
    tiers.copies_done(copies)
    tiers.writes_done([(slot, True) for _, slot in copies.spills])
    kv.free(again)
    assert tiers.num_disk_loaded == 2
    assert_tiers_clean(tiers)


def test_a_disk_block_is_no_hit_until_its_write_finished() -> None:
    kv, pool, tiers = make_tiered(num_blocks=2, num_host=1)
    prompt = make_request("a", BLOCK_SIZE + 1).prompt_token_ids
    run(kv, make_request("a", prompt=prompt))
    run(kv, make_request("b", BLOCK_SIZE + 1))  # a0 -> host
    hits, _ = kv.get_computed_blocks(make_request("c", prompt=prompt))
    assert isinstance(hits[0], HostHit)
    req = make_request("d", BLOCK_SIZE + 1)
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    copies = tiers.take_copies()  # b0 -> host evicts a0: spilled, its write still pending
    assert len(copies.spills) == 1 and tiers.num_pending_spills == 1
    tiers.copies_done(copies)
    kv.free(req)
    assert kv.get_computed_blocks(make_request("e", prompt=prompt))[0] == []
    tiers.writes_done([(copies.spills[0][1], True)])
    hits, _ = kv.get_computed_blocks(make_request("f", prompt=prompt))
    assert [type(h) for h in hits] == [DiskHit]
    assert_tiers_clean(tiers)


def test_the_disk_evicts_its_least_recently_used_block() -> None:
    kv, pool, tiers = make_tiered(num_blocks=2, num_host=1, num_disk=2)
    first = [make_request(f"p{i}", BLOCK_SIZE + 1) for i in range(4)]
    for req in first:  # each pushes the one before it down a tier
        run(kv, req)
    disk = tiers.disk
    assert disk.cached_hashes() == [first[0].block_hashes[0], first[1].block_hashes[0]]
    pool.take_events()
    run(kv, make_request("x", BLOCK_SIZE + 1))  # p2 spills: p0, the oldest, leaves the disk
    events = pool.take_events()
    assert BlockRemoved((first[0].block_hashes[0],), DISK) in events
    assert BlockMoved((first[2].block_hashes[0],), HOST, DISK) in events
    assert disk.cached_hashes() == [first[1].block_hashes[0], first[2].block_hashes[0]]
    assert tiers.num_disk_evicted == 1
    assert_tiers_clean(tiers)


def test_spills_past_the_pending_bound_are_dropped_not_waited_for() -> None:
    kv, pool, tiers = make_tiered(num_blocks=4, num_host=1, num_disk=8, max_pending=1)
    for i in range(5):  # writes never finish: only the first spill is taken
        run(kv, make_request(f"p{i}", 3 * BLOCK_SIZE + 1), write=False)
    assert tiers.num_pending_spills == 1 and tiers.num_spilled == 1
    assert tiers.num_spills_dropped >= 2
    events = pool.take_events()
    assert sum(len(e.block_hashes) for e in events
               if isinstance(e, BlockMoved) and e.dst == DISK) == 1
    assert any(isinstance(e, BlockRemoved) and e.medium == HOST for e in events)
    assert_tiers_clean(tiers)  # the one pending write is the only pinned disk slot


def test_a_failed_write_is_forgotten() -> None:
    kv, pool, tiers = make_tiered(num_blocks=2, num_host=1)
    run(kv, make_request("a", BLOCK_SIZE + 1))
    run(kv, make_request("b", BLOCK_SIZE + 1))
    req = make_request("c", BLOCK_SIZE + 1)
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    copies = tiers.take_copies()
    tiers.copies_done(copies)
    kv.free(req)
    pool.take_events()
    (_, slot), = copies.spills
    gone = tiers.disk.cached_hashes()[-1]
    tiers.writes_done([(slot, False)])
    assert pool.take_events() == [BlockRemoved((gone,), DISK)]
    assert gone not in tiers.disk.cached_hashes()
    assert_tiers_clean(tiers)


def test_pull_lookups_never_claim_disk_blocks() -> None:
    kv, pool, tiers = make_tiered()
    prompt = spilled_prompt(kv)
    hashes = make_request("a", prompt=prompt).block_hashes[:2]
    assert len(tiers.longest_prefix(hashes)) == 2
    assert tiers.longest_prefix(hashes, include_disk=False) == []


def test_reset_clears_every_tier() -> None:
    kv, pool, tiers = make_tiered()
    spilled_prompt(kv)
    assert tiers.disk.num_cached > 0
    assert tiers.reset()
    assert tiers.cached_hashes() == [] and tiers.disk.num_cached == 0
    assert_tiers_clean(tiers)


def test_index_fed_by_the_events_matches_all_three_tiers() -> None:
    for seed in range(4):
        rng = random.Random(seed)
        kv, pool, tiers = make_tiered(num_blocks=6, num_host=3, num_disk=4,
                                      max_pending=rng.choice([1, 64]))
        index = BlockIndex()
        index.add_node("n")
        prompts = [make_request(f"p{i}", rng.randint(1, 4) * BLOCK_SIZE + 1).prompt_token_ids
                   for i in range(6)]
        pending: list[int] = []
        for step in range(60):
            base = rng.choice(prompts)
            prompt = base[:rng.randint(1, len(base))] + [rng.randint(5, 9)]
            pending += run(kv, make_request(f"r{step}", prompt=prompt),
                           write=rng.random() < 0.7)
            if pending and rng.random() < 0.3:  # the writer catches up now and then
                tiers.writes_done([(slot, True) for slot in pending])
                pending = []
            apply_events(index, "n", pool.take_events())
            media = tiers.cached_media()
            assert index.node_blocks("n") == set(media)
            node_media = index.node_media("n")
            for block_hash, mask in media.items():
                assert node_media.get(block_hash, 1) == mask
            index.check_invariants()
        tiers.writes_done([(slot, True) for slot in pending])
        assert_tiers_clean(tiers)
        assert_pool_clean(pool)


def test_a_peer_pull_is_served_from_the_host_but_never_from_the_disk() -> None:
    from pdcluster.core.kv_connector import ConnectorResults, PrefixTokens, PullLookup
    from pdcluster.engine.core.scheduler import Scheduler, SchedulerConfig
    from pdcluster.transfer.connector_scheduler import ConnectorScheduler

    kv, pool, tiers = make_tiered(num_host=4)
    connector = ConnectorScheduler(min_pull_blocks=1)
    sched = Scheduler(SchedulerConfig(64, 8, 256), kv, connector)
    on_disk = spilled_prompt(kv)
    on_host = make_request("h", 2 * BLOCK_SIZE + 1).prompt_token_ids
    run(kv, make_request("h", prompt=on_host))
    run(kv, make_request("g", 3 * BLOCK_SIZE + 1))  # h's blocks move to the host
    disk_hashes = make_request("d", prompt=on_disk).block_hashes[:2]
    disk_hits = tiers.longest_prefix(disk_hashes)
    assert disk_hits and all(isinstance(h, DiskHit) for h in disk_hits)
    served = {}
    for name, prompt in (("disk", on_disk), ("host", on_host)):
        lookup = PullLookup(f"pull-{name}", PrefixTokens(prompt[:2 * BLOCK_SIZE], BLOCK_SIZE, 0))
        sched.apply_connector_results(ConnectorResults(lookups=[lookup]))
        served[name] = [s.block_ids for s in connector.build_plan().serves]
        sched.apply_connector_results(ConnectorResults(served=[f"pull-{name}"]))
    assert served["disk"] in ([], [[]])  # nothing claimed from the disk
    (host_ids,) = served["host"]  # ids past the device's name host slots
    assert len(host_ids) == 2 and all(i >= pool.num_blocks for i in host_ids)
    assert_tiers_clean(tiers)


def spilled_unwritten(kv: KVCacheManager) -> tuple[list[int], list[int]]:
    """`spilled_prompt` with every disk write left pending: the prompt and the pending slots."""
    prompt = make_request("a", 2 * BLOCK_SIZE + 1).prompt_token_ids
    pending = run(kv, make_request("a", prompt=prompt), write=False)
    for i in range(3):
        pending += run(kv, make_request(f"f{i}", 3 * BLOCK_SIZE + 1), write=False)
    return prompt, pending


def test_at_two_ranks_a_disk_slot_is_a_hit_once_both_wrote_it() -> None:
    kv, pool, tiers = make_tiered(num_ranks=2)
    prompt, pending = spilled_unwritten(kv)
    hashes = make_request("a", prompt=prompt).block_hashes[:2]
    tiers.writes_done([(slot, True) for slot in pending])  # rank 0's writer
    assert tiers.longest_prefix(hashes) == []
    assert tiers.num_pending_spills == len(pending)
    tiers.writes_done([(slot, True) for slot in pending])  # rank 1's
    assert [type(h) for h in tiers.longest_prefix(hashes)] == [DiskHit, DiskHit]
    assert tiers.num_pending_spills == 0
    assert_tiers_clean(tiers)


def test_at_two_ranks_one_failed_write_forgets_the_block() -> None:
    kv, pool, tiers = make_tiered(num_ranks=2)
    prompt, pending = spilled_unwritten(kv)
    first = make_request("a", prompt=prompt).block_hashes[0]
    slot = tiers.disk.lookup(first)
    pool.take_events()
    tiers.writes_done([(slot, True)])
    tiers.writes_done([(slot, False)])  # the other rank's write failed: no whole copy
    assert pool.take_events() == [BlockRemoved((first,), DISK)]
    assert tiers.disk.lookup(first) is None
    rest = [s for s in pending if s != slot]
    tiers.writes_done([(s, True) for s in rest + rest])
    assert_tiers_clean(tiers)


def test_at_two_ranks_a_peer_pull_is_served_from_the_host_too() -> None:
    """Every rank registers its host tier (transfer/group_writer.py writes each rank's slice
    of a host block from there): a pull claims host slots at TP=2 as at TP=1, never a disk
    block."""
    from pdcluster.core.kv_connector import ConnectorResults, PrefixTokens, PullLookup
    from pdcluster.engine.core.scheduler import Scheduler, SchedulerConfig
    from pdcluster.transfer.connector_scheduler import ConnectorScheduler

    kv, pool, tiers = make_tiered(num_host=4, num_ranks=2)
    connector = ConnectorScheduler(min_pull_blocks=1)
    sched = Scheduler(SchedulerConfig(64, 8, 256), kv, connector)
    on_host = make_request("h", 2 * BLOCK_SIZE + 1).prompt_token_ids
    run(kv, make_request("h", prompt=on_host))
    on_device = make_request("g", 3 * BLOCK_SIZE + 1).prompt_token_ids
    run(kv, make_request("g", prompt=on_device))  # h's blocks move to the host
    assert all(isinstance(h, HostHit) for h in
               tiers.longest_prefix(make_request("h", prompt=on_host).block_hashes[:2]))
    served = {}
    for name, prompt in (("host", on_host), ("device", on_device)):
        lookup = PullLookup(f"pull-{name}", PrefixTokens(prompt[:2 * BLOCK_SIZE], BLOCK_SIZE, 0))
        sched.apply_connector_results(ConnectorResults(lookups=[lookup]))
        served[name] = [s.block_ids for s in connector.build_plan().serves]
        sched.apply_connector_results(ConnectorResults(served=[f"pull-{name}"]))
    (host_ids,) = served["host"]
    assert len(host_ids) == 2 and all(i >= pool.num_blocks for i in host_ids)
    (device_ids,) = served["device"]
    assert len(device_ids) == 2 and all(i < pool.num_blocks for i in device_ids)
    assert_tiers_clean(tiers)
