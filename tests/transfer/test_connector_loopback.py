"""The production KV connector (scheduler side + worker) between two real engines in one
process, over the loopback fake transport: exact tokens, fewer blocks on prefix hits, and the
failure semantics (timeouts, failed writes, aborts on either side, late messages), with a leak
check on both engines after every scenario."""

from __future__ import annotations

import logging

import pytest

from pdcluster.core.kv_transfer import RemoteDecode, RemotePrefill, XferDone, XferRequest
from pdcluster.engine import SamplingParams
from tests.helpers import assert_pool_clean
from tests.models import random_prompts
from tests.transfer.disagg import FakeClock, drive, idle, make_engine, submit
from tests.transfer.loopback import LoopbackFabric

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def fabric():
    return LoopbackFabric()


@pytest.fixture
def pair(model_dirs, fabric):
    p_transport, d_transport = fabric.transport(), fabric.transport()
    prefill = make_engine(model_dirs["llama-gqa"], p_transport)
    decode = make_engine(model_dirs["llama-gqa"], d_transport)
    yield prefill, decode, p_transport.reply_address
    for engine in (prefill, decode):
        engine.close()


def finish_all(prefill, decode, **kw):
    return drive([prefill, decode], lambda: idle(prefill) and idle(decode), **kw)


def assert_clean(*engines):
    for engine in engines:
        assert_pool_clean(engine.block_pool)


def test_tokens_match_transformers(pair, model_dirs, hf_reference):
    prefill, decode, addr = pair
    prompts = random_prompts(6, 3, 50, seed=20)
    runs = [submit(prefill, decode, p, GREEDY, addr) for p in prompts]
    final = finish_all(prefill, decode)
    for prompt, run in zip(prompts, runs, strict=True):
        assert final[run.decode_id].token_ids == hf_reference(model_dirs["llama-gqa"], prompt, 8)
        assert final[run.prefill_id].token_ids == final[run.decode_id].token_ids[:1]
    stats = prefill.connector.worker.stats
    assert stats.sends_ok == 6 and stats.blocks_sent == sum(-(-len(p) // 8) for p in prompts)
    assert_clean(prefill, decode)


def test_consecutive_blocks_are_one_descriptor(pair):
    prefill, decode, addr = pair
    submit(prefill, decode, random_prompts(1, 60, 60, seed=21)[0], GREEDY, addr)
    finish_all(prefill, decode)
    stats = prefill.connector.worker.stats
    assert stats.blocks_sent == 8 and stats.descriptors_sent == 1  # fresh pools: contiguous
    assert_clean(prefill, decode)


def test_second_turn_transfers_only_missing_blocks(pair, model_dirs, hf_reference):
    prefill, decode, addr = pair
    turn1 = random_prompts(1, 40, 40, seed=22)[0]
    run1 = submit(prefill, decode, turn1, GREEDY, addr)
    answer = finish_all(prefill, decode)[run1.decode_id].token_ids
    turn2 = turn1 + answer + random_prompts(1, 10, 10, seed=23)[0]  # 58 tokens, 8 blocks
    sent_before = prefill.connector.worker.stats.blocks_sent
    run = submit(prefill, decode, turn2, GREEDY, addr)
    final = finish_all(prefill, decode)
    assert final[run.decode_id].token_ids == hf_reference(model_dirs["llama-gqa"], turn2, 8)
    # D computed 47 tokens of turn 1 (the last answer token is never fed back): 5 full blocks.
    assert final[run.decode_id].num_cached_tokens == 40
    assert prefill.connector.worker.stats.blocks_sent - sent_before == 8 - 5
    assert_clean(prefill, decode)


def test_decode_request_before_prefill_starts(pair, model_dirs, hf_reference):
    prefill, decode, addr = pair
    prompt = random_prompts(1, 30, 30, seed=24)[0]
    run = submit(None, decode, prompt, GREEDY, addr)
    for _ in range(5):
        decode.step()
    fabric_wait = drive([decode], lambda: True)  # nothing runs on D while it waits
    assert fabric_wait == {} and decode.scheduler.waiting_for_remote
    prefill.add_request(run.prefill_id, prompt, SamplingParams(max_tokens=1, temperature=0),
                        kv_transfer=RemoteDecode(run.transfer_id))
    final = finish_all(prefill, decode)
    assert final[run.decode_id].token_ids == hf_reference(model_dirs["llama-gqa"], prompt, 8)
    assert_clean(prefill, decode)


def test_prefill_never_answers_then_decode_recomputes(model_dirs, fabric, hf_reference):
    clock = FakeClock()
    p_transport, d_transport = fabric.transport(), fabric.transport()
    fabric.drop_messages_to.add(p_transport.reply_address)  # P never hears from D
    prefill = make_engine(model_dirs["llama-gqa"], p_transport, clock=clock, timeout_s=2)
    decode = make_engine(model_dirs["llama-gqa"], d_transport, clock=clock, timeout_s=2)
    prompt = random_prompts(1, 25, 25, seed=25)[0]
    run = submit(prefill, decode, prompt, GREEDY, p_transport.reply_address)
    drive([prefill, decode], lambda: prefill.has_pinned_blocks())
    clock.now += 3  # both sides time out
    final = finish_all(prefill, decode)
    assert final[run.decode_id].token_ids == hf_reference(model_dirs["llama-gqa"], prompt, 8)
    assert decode.connector.worker.stats.timeouts == 1
    assert prefill.connector.worker.stats.timeouts == 1
    assert_clean(prefill, decode)


def test_a_lost_request_is_named_in_the_prefill_nodes_log(model_dirs, fabric, hf_reference,
                                                          caplog):
    """D's request never reaches P: D gives up at its timeout and recomputes, and its abort
    tells P why, so P's log says where the transfer stalled (its request never came)."""
    clock = FakeClock()
    p_transport, d_transport = fabric.transport(), fabric.transport()
    fabric.drop_kinds = (XferRequest,)
    prefill = make_engine(model_dirs["llama-gqa"], p_transport, clock=clock, timeout_s=10)
    decode = make_engine(model_dirs["llama-gqa"], d_transport, clock=clock, timeout_s=2)
    prompt = random_prompts(1, 25, 25, seed=27)[0]
    run = submit(prefill, decode, prompt, GREEDY, p_transport.reply_address)
    drive([prefill, decode], lambda: prefill.has_pinned_blocks())
    clock.now += 3  # D times out, P does not
    with caplog.at_level(logging.WARNING, logger="pdcluster.transfer.connector_worker"):
        final = finish_all(prefill, decode)
    assert final[run.decode_id].token_ids == hf_reference(model_dirs["llama-gqa"], prompt, 8)
    assert (decode.connector.worker.stats.timeouts, prefill.connector.worker.stats.timeouts) \
        == (1, 0)
    assert "its requester gave up (no KV within 2 s); here its request never came" \
        in caplog.text
    assert_clean(prefill, decode)


def test_fail_policy_reports_the_transfer_error(model_dirs, fabric):
    p_transport, d_transport = fabric.transport(), fabric.transport()
    prefill = make_engine(model_dirs["llama-gqa"], p_transport)
    decode = make_engine(model_dirs["llama-gqa"], d_transport, recompute_on_failure=False)
    fabric.fail_writes = True
    run = submit(prefill, decode, random_prompts(1, 20, 20, seed=26)[0], GREEDY,
                 p_transport.reply_address)
    final = finish_all(prefill, decode)
    out = final[run.decode_id]
    assert out.finish_reason == "error" and "KV transfer failed" in out.error
    assert out.token_ids == []
    assert prefill.connector.worker.stats.sends_failed == 1
    assert_clean(prefill, decode)


def test_failed_write_recomputes_by_default(pair, fabric, model_dirs, hf_reference):
    prefill, decode, addr = pair
    fabric.fail_writes = True
    prompt = random_prompts(1, 33, 33, seed=27)[0]
    run = submit(prefill, decode, prompt, GREEDY, addr)
    final = finish_all(prefill, decode)
    assert final[run.decode_id].token_ids == hf_reference(model_dirs["llama-gqa"], prompt, 8)
    assert_clean(prefill, decode)


def test_abort_on_decode_while_waiting_releases_both(model_dirs, fabric):
    clock = FakeClock()
    p_transport, d_transport = fabric.transport(), fabric.transport()
    prefill = make_engine(model_dirs["llama-gqa"], p_transport, clock=clock)
    decode = make_engine(model_dirs["llama-gqa"], d_transport, clock=clock)
    run = submit(None, decode, random_prompts(1, 40, 40, seed=28)[0], GREEDY,
                 p_transport.reply_address)
    decode.step()
    fabric.flush()
    assert decode.abort_request(run.decode_id)
    assert decode.has_pinned_blocks()  # P might still write: held until P answers
    finish_all(prefill, decode)  # P answers the abort for the unknown transfer
    assert_clean(prefill, decode)


def test_abort_on_prefill_before_it_finishes(pair, model_dirs, hf_reference):
    prefill, decode, addr = pair
    prompt = random_prompts(1, 40, 40, seed=29)[0]
    run = submit(prefill, decode, prompt, GREEDY, addr)
    assert prefill.abort_request(run.prefill_id)
    final = finish_all(prefill, decode)
    assert final[run.decode_id].token_ids == hf_reference(model_dirs["llama-gqa"], prompt, 8)
    assert_clean(prefill, decode)


def test_duplicate_and_late_messages_are_harmless(pair, fabric):
    prefill, decode, addr = pair
    run = submit(prefill, decode, random_prompts(1, 20, 20, seed=30)[0], GREEDY, addr)
    finish_all(prefill, decode)
    d_worker = decode.connector.worker
    d_worker.transport.deliver(XferDone(run.transfer_id, True, first_token=5))
    d_worker.transport.deliver(XferDone("never-seen", False, error="x"))
    stale = XferRequest(run.transfer_id, run.decode_id, decode.connector.worker.transport
                        .reply_address, "nowhere", 1, 1, 0, [4096])
    prefill.connector.worker.transport.deliver(stale)  # answered "finished", nothing sent
    fabric.flush()
    assert d_worker.stats.late_messages == 3
    finish_all(prefill, decode)
    assert_clean(prefill, decode)


def test_abort_on_prefill_while_pinned(pair, model_dirs, hf_reference):
    prefill, decode, addr = pair
    prompt = random_prompts(1, 24, 24, seed=31)[0]
    prefill.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1),
                        kv_transfer=RemoteDecode("t-pinned"))
    drive([prefill], lambda: prefill.has_pinned_blocks())  # prefill done, D not heard yet
    assert not prefill.abort_request("p")  # already finished: only its send is cancelled
    drive([prefill], lambda: not prefill.has_pinned_blocks())
    decode.add_request("d", prompt, GREEDY, kv_transfer=RemotePrefill("t-pinned", addr))
    final = finish_all(prefill, decode)
    assert final["d"].token_ids == hf_reference(model_dirs["llama-gqa"], prompt, 8)
    assert decode.connector.worker.stats.recvs_failed == 1  # "transfer aborted" -> recompute
    assert_clean(prefill, decode)
