"""Bounded pins (engine/core/pins.py): blocks held for other nodes — remote decodes waiting for
their decode node, prefix pulls being served — stay within the node's budget in count, and a
send pin expires after `pin_timeout_s`. Torch-free scheduler scenarios (the production
connector scheduler, the test playing the worker), then one on two real engines over the
loopback connector. Prefix pulls this node makes count too: one past the budget is not made.
Every scenario ends with a leak check."""

from __future__ import annotations

import time

import pytest

from pdcluster.core.kv_connector import (
    ConnectorResults,
    PrefixTokens,
    PullLookup,
    PullResult,
    RecvResult,
)
from pdcluster.core.kv_transfer import RemoteDecode, RemotePrefill
from pdcluster.engine.core.block_pool import BlockPool
from pdcluster.engine.core.kv_cache_manager import KVCacheManager
from pdcluster.engine.core.pins import OverloadedError, PinBudget
from pdcluster.engine.core.request import RequestStatus
from pdcluster.engine.core.scheduler import Scheduler, SchedulerConfig
from pdcluster.transfer.connector_scheduler import ConnectorScheduler
from tests.engine.test_kv_cache_manager import BLOCK_SIZE, make_request
from tests.engine.test_prefix_pulls import pulling
from tests.engine.test_scheduler import run_all, step
from tests.helpers import assert_pool_clean
from tests.transfer.disagg import FakeClock


def make_scheduler(max_pinned_blocks: int, clock: FakeClock | None = None):
    pool = BlockPool(32, BLOCK_SIZE)
    connector = ConnectorScheduler()
    config = SchedulerConfig(64, 8, 256, max_pinned_blocks, pin_timeout_s=5.0)
    sched = Scheduler(config, KVCacheManager(pool), connector, clock=clock or FakeClock())
    return sched, pool, connector


def remote_decode(request_id: str, prompt_len: int = 8):
    req = make_request(request_id, prompt_len, max_tokens=1)
    req.kv_transfer = RemoteDecode(f"t-{request_id}")
    return req


def test_budget_unit_rules():
    clock = FakeClock()
    budget = PinBudget(4, 1.0, clock)
    assert not budget.try_reserve(("send", "a"), 6)  # not even alone may one pass the bound
    assert budget.try_reserve(("send", "a"), 4)
    assert not budget.try_reserve(("send", "b"), 1) and budget.num_refused == 2
    budget.release(("send", "a"))
    assert budget.try_reserve(("send", "b"), 3) and budget.grant(("serve", "x"), 5) == 1
    assert budget.grant(("serve", "y"), 2) == 0 and budget.num_serves_cut == 2
    budget.start_clock(("send", "b"))
    clock.now += 1.0
    assert budget.expired() == [("send", "b")] and budget.expired() == []
    budget.release(("send", "b"))
    budget.release(("serve", "x"))
    assert budget.num_used == 0


def test_remote_decodes_past_the_budget_are_refused_at_admission():
    sched, pool, _ = make_scheduler(max_pinned_blocks=8)
    for i in range(4):  # 8 prompt tokens, max_tokens 1: 2 blocks each
        sched.add_request(remote_decode(f"r{i}"))
    with pytest.raises(OverloadedError, match="8 of at most 8"):
        sched.add_request(remote_decode("r4"))
    assert "r4" not in sched.requests
    sched.add_request(make_request("local", 40))  # a local request is not counted
    run_all(sched)
    assert sorted(sched.pinned) == [f"r{i}" for i in range(4)]
    sched.apply_connector_results(ConnectorResults(released=[f"r{i}" for i in range(4)]))
    assert sched.pins.num_used == 0
    sched.add_request(remote_decode("r5"))  # room again
    run_all(sched)
    sched.apply_connector_results(ConnectorResults(released=["r5"]))
    assert_pool_clean(pool)


def test_an_aborted_remote_decode_gives_its_reservation_back():
    sched, pool, _ = make_scheduler(max_pinned_blocks=4)
    sched.add_request(remote_decode("a"))
    sched.add_request(remote_decode("b"))
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)  # before its prefill
    assert sched.pins.num_used == 2
    sched.add_request(remote_decode("c"))
    run_all(sched)
    sched.apply_connector_results(ConnectorResults(released=["b", "c"]))
    assert sched.pins.num_used == 0
    assert_pool_clean(pool)


def test_a_send_pin_expires_and_the_send_is_cancelled():
    clock = FakeClock()
    sched, pool, connector = make_scheduler(max_pinned_blocks=16, clock=clock)
    sched.add_request(remote_decode("r"))
    run_all(sched)
    assert "r" in sched.pinned
    connector.build_plan()
    clock.now += 4.9
    sched.expire_pins()
    assert not connector.build_plan().cancelled  # not yet
    clock.now += 0.2
    sched.expire_pins()
    assert connector.build_plan().cancelled == ["t-r"]
    sched.expire_pins()
    assert not connector.build_plan().cancelled  # cancelled once
    sched.apply_connector_results(ConnectorResults(released=["r"]))  # the worker's answer
    assert not sched.pinned and sched.pins.num_used == 0 and sched.pins.num_expired == 1
    assert_pool_clean(pool)


def test_served_pulls_are_cut_to_what_the_budget_has_left():
    sched, pool, connector = make_scheduler(max_pinned_blocks=3)
    held = make_request("h", 22)
    sched.add_request(held)
    run_all(sched)
    prefix = PrefixTokens(list(held.prompt_token_ids[:20]), BLOCK_SIZE, 0)
    lookups = [PullLookup("pull-1", prefix), PullLookup("pull-2", prefix)]
    sched.apply_connector_results(ConnectorResults(lookups=lookups))
    first, second = connector.build_plan().serves
    assert len(first.block_ids) == 3 and second.block_ids == []
    sched.apply_connector_results(ConnectorResults(served=["pull-1", "pull-2"]))
    assert sched.pins.num_used == 0
    sched.apply_connector_results(ConnectorResults(lookups=[PullLookup("pull-3", prefix)]))
    assert len(connector.build_plan().serves[0].block_ids) == 3  # the budget is back
    sched.apply_connector_results(ConnectorResults(served=["pull-3"]))
    assert_pool_clean(pool)


def test_a_pull_past_the_budget_is_not_made_and_the_prefix_is_computed():
    sched, pool, connector = make_scheduler(max_pinned_blocks=6)
    first, second = pulling(22, 5, "first"), pulling(22, 5, "second")
    sched.add_request(first)
    sched.add_request(second)
    (chunk,) = step(sched).chunks  # "first" parks: 5 of the 6 blocks
    assert chunk.request_id == "second" and chunk.start == 0  # computed, not pulled
    assert len(connector.build_plan().pulls) == 1 and sched.pulls.num_pulls_skipped >= 1
    assert sched.pins.num_used == 5
    sched.apply_connector_results(ConnectorResults(pulled=[PullResult("first", True, 5)]))
    assert sched.pins.num_used == 0
    run_all(sched)
    assert_pool_clean(pool)


def test_an_aborted_pull_holds_its_budget_until_the_holder_answers():
    sched, pool, connector = make_scheduler(max_pinned_blocks=16)
    sched.add_request(pulling(22, 5, "r"))
    step(sched)
    sched.finish_request("r", RequestStatus.FINISHED_ABORTED)
    assert "r" in sched.pinned and sched.pins.num_used == 5
    sched.apply_connector_results(ConnectorResults(pulled=[PullResult("r", False, 0, "x")]))
    assert sched.pins.num_used == 0
    assert_pool_clean(pool)


def test_an_unclaimed_send_is_released_after_the_pin_timeout(model_dirs, hf_reference):
    """Two real engines over the loopback connector: P's pin expires long before the
    connector's own 5 s timeout, and a decode node asking after that recomputes."""
    from pdcluster.engine import SamplingParams
    from tests.transfer.disagg import drive, idle, make_engine
    from tests.transfer.loopback import LoopbackFabric

    model = model_dirs["llama-gqa"]
    fabric = LoopbackFabric()
    p_transport = fabric.transport()
    prefill = make_engine(model, p_transport, pin_timeout_s=0.3)
    decode = make_engine(model, fabric.transport())
    prompt = [5, 17, 99, 1024, 7, 300, 12, 8, 9, 31, 4000]
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    try:
        prefill.add_request("p", prompt, greedy, kv_transfer=RemoteDecode("t"))
        drive([prefill], lambda: "p" in prefill.scheduler.pinned)
        started = time.monotonic()
        drive([prefill], lambda: idle(prefill))
        assert 0.25 < time.monotonic() - started < 3.0
        assert prefill.stats()["num_pins_expired"] == 1
        assert_pool_clean(prefill.block_pool)
        decode.add_request("d", prompt, SamplingParams(max_tokens=6, temperature=0.0,
                                                       ignore_eos=True),
                           kv_transfer=RemotePrefill("t", p_transport.reply_address))
        final = drive([prefill, decode], lambda: idle(decode) and idle(prefill))
        assert final["d"].token_ids == hf_reference(model, prompt, 6)
        assert decode.connector.worker.stats.recvs_failed == 1  # "transfer aborted": recomputed
        assert_pool_clean(decode.block_pool)
    finally:
        prefill.close()
        decode.close()


def remote_prefill(request_id: str, prompt_len: int):
    req = make_request(request_id, prompt_len, max_tokens=2)
    req.kv_transfer = RemotePrefill(f"t-{request_id}", "tcp://prefill:1")
    return req


def test_remote_prefills_hold_their_blocks_within_the_budget():
    """Blocks a decode node parks for a prefill node's write count against the budget: past
    it, a remote prefill waits for room (like a request the pool cannot take yet)."""
    sched, pool, connector = make_scheduler(max_pinned_blocks=6)
    for name in "abc":
        sched.add_request(remote_prefill(name, 3 * BLOCK_SIZE))  # 3 blocks each
    step(sched)
    assert sorted(sched.waiting_for_remote) == ["a", "b"] and sched.pins.num_used == 6
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert [job.request_id for job in connector.build_plan().recvs] == ["a", "b"]
    sched.apply_connector_results(ConnectorResults(received=[RecvResult("a", True, 5, None)]))
    assert sched.pins.num_used == 3  # a's blocks are its own now
    step(sched)
    assert sorted(sched.waiting_for_remote) == ["b", "c"] and sched.pins.num_used == 6
    sched.finish_request("b", RequestStatus.FINISHED_ABORTED)  # pinned until P answers
    sched.apply_connector_results(ConnectorResults(
        received=[RecvResult("b", False, error="aborted"), RecvResult("c", False, error="x")]))
    assert sched.pins.num_used == 0  # b released, c recomputes its prompt itself
    run_all(sched)
    assert_pool_clean(pool)


def test_a_remote_prefill_past_the_whole_budget_computes_its_prompt():
    sched, pool, connector = make_scheduler(max_pinned_blocks=2)
    sched.add_request(remote_prefill("big", 3 * BLOCK_SIZE))
    (chunk,) = step(sched).chunks
    assert (chunk.request_id, chunk.start) == ("big", 0)  # computed here, not parked
    assert connector.build_plan().cancelled == ["t-big"]
    assert sched.num_remote_prefills_computed == 1 and sched.pins.num_used == 0
    run_all(sched)
    assert_pool_clean(pool)


def test_a_remote_decode_past_the_whole_budget_is_refused_even_alone():
    sched, pool, _ = make_scheduler(max_pinned_blocks=4)
    with pytest.raises(OverloadedError, match="more than this node holds for other nodes"):
        sched.add_request(remote_decode("big", prompt_len=5 * BLOCK_SIZE))
    assert sched.pins.num_used == 0 and sched.pins.num_refused == 1
    assert_pool_clean(pool)
