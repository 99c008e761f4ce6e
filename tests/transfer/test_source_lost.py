"""`ConnectorWorker.fail_receive`: a decode node told that its prefill node died gives up on
the KV at once and recomputes the prompt (exact tokens), long before its KV timeout, with
nothing leaked; a late answer from the dead transfer changes nothing. A source the side
channel cannot reach fails the receive as at once (`sources_unreachable`), and when the
router's word comes too, whichever is first fails it — once."""

from __future__ import annotations

from pdcluster.core.kv_transfer import XferDone
from pdcluster.engine import SamplingParams
from tests.helpers import assert_pool_clean
from tests.models import random_prompts
from tests.transfer.disagg import FakeClock, drive, idle, make_engine, submit
from tests.transfer.loopback import LoopbackFabric

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_a_lost_source_is_recomputed_at_once(model_dirs, hf_reference):
    fabric, clock = LoopbackFabric(), FakeClock()  # the clock never moves: no timeout
    p_transport, d_transport = fabric.transport(), fabric.transport()
    fabric.drop_messages_to.add(p_transport.reply_address)  # P never answers
    decode = make_engine(model_dirs["llama-gqa"], d_transport, clock=clock, timeout_s=30)
    prompt = random_prompts(1, 30, 30, seed=90)[0]
    run = submit(None, decode, prompt, GREEDY, p_transport.reply_address)
    for _ in range(3):
        decode.step()
    assert decode.scheduler.waiting_for_remote and decode.connector.worker.num_pending_receives

    worker = decode.connector.worker
    assert worker.fail_receive(run.transfer_id, "prefill node lost: p0 disconnected")
    assert not worker.fail_receive(run.transfer_id, "again")  # already given up
    final = drive([decode], lambda: idle(decode))

    assert final[run.decode_id].token_ids == hf_reference(model_dirs["llama-gqa"], prompt, 8)
    assert worker.stats.sources_lost == 1 and worker.stats.timeouts == 0
    # the dead transfer's answer, should one still come, is only counted as late
    d_transport.deliver(XferDone(run.transfer_id, True, first_token=5))
    assert worker.stats.late_messages == 1
    assert_pool_clean(decode.block_pool)
    decode.close()


def test_an_unknown_or_finished_transfer_is_not_failed(model_dirs):
    fabric = LoopbackFabric()
    p_transport, d_transport = fabric.transport(), fabric.transport()
    prefill = make_engine(model_dirs["llama-gqa"], p_transport)
    decode = make_engine(model_dirs["llama-gqa"], d_transport)
    assert not decode.connector.worker.fail_receive("no-such-transfer", "lost")
    run = submit(prefill, decode, random_prompts(1, 30, 30, seed=91)[0], GREEDY,
                 p_transport.reply_address)
    drive([prefill, decode], lambda: idle(prefill) and idle(decode))
    assert not decode.connector.worker.fail_receive(run.transfer_id, "lost")
    assert decode.connector.worker.stats.sources_lost == 0
    for engine in (prefill, decode):
        assert_pool_clean(engine.block_pool)
        engine.close()


def test_a_source_lost_before_the_receive_starts_fails_it_as_it_starts(model_dirs,
                                                                       hf_reference):
    fabric, clock = LoopbackFabric(), FakeClock()
    p_transport, d_transport = fabric.transport(), fabric.transport()
    decode = make_engine(model_dirs["llama-gqa"], d_transport, clock=clock, timeout_s=30)
    prompt = random_prompts(1, 30, 30, seed=92)[0]
    run = submit(None, decode, prompt, GREEDY, p_transport.reply_address)
    worker = decode.connector.worker
    # told before its first step: the request is still queued, no receive has started
    assert not worker.fail_receive(run.transfer_id, "prefill node lost: p0: overloaded")
    final = drive([decode], lambda: idle(decode))
    assert final[run.decode_id].token_ids == hf_reference(model_dirs["llama-gqa"], prompt, 8)
    assert worker.stats.sources_lost == 1 and worker.stats.timeouts == 0
    assert_pool_clean(decode.block_pool)
    decode.close()


def test_an_unreachable_source_fails_the_receive_at_once(model_dirs, hf_reference):
    fabric, clock = LoopbackFabric(), FakeClock()  # the clock never moves: no timeout
    p_transport, d_transport = fabric.transport(), fabric.transport()
    fabric.refuse_messages_to.add(p_transport.reply_address)  # P's socket is gone
    decode = make_engine(model_dirs["llama-gqa"], d_transport, clock=clock, timeout_s=30)
    prompt = random_prompts(1, 30, 30, seed=93)[0]
    run = submit(None, decode, prompt, GREEDY, p_transport.reply_address)
    worker = decode.connector.worker
    final = drive([decode], lambda: idle(decode))
    assert final[run.decode_id].token_ids == hf_reference(model_dirs["llama-gqa"], prompt, 8)
    assert worker.stats.sources_unreachable == 1 and worker.stats.recvs_failed == 1
    assert worker.stats.sources_lost == 0 and worker.stats.timeouts == 0
    # the router's word, coming after, finds nothing left to fail
    assert not worker.fail_receive(run.transfer_id, "prefill node lost: p0 disconnected")
    assert worker.stats.sources_lost == 0 and worker.stats.recvs_failed == 1
    assert_pool_clean(decode.block_pool)
    decode.close()


def test_the_routers_word_first_leaves_nothing_for_the_transport_to_fail(model_dirs,
                                                                         hf_reference):
    fabric, clock = LoopbackFabric(), FakeClock()
    p_transport, d_transport = fabric.transport(), fabric.transport()
    fabric.drop_messages_to.add(p_transport.reply_address)  # held, as by a stopped peer
    decode = make_engine(model_dirs["llama-gqa"], d_transport, clock=clock, timeout_s=30)
    prompt = random_prompts(1, 30, 30, seed=94)[0]
    run = submit(None, decode, prompt, GREEDY, p_transport.reply_address)
    for _ in range(3):
        decode.step()
    worker = decode.connector.worker
    assert worker.fail_receive(run.transfer_id, "prefill node lost: p0 disconnected")
    fabric.flush()
    assert len(fabric.dropped_handlers) == 1  # the request to P, never delivered
    fabric.dropped_handlers[0]("the peer is gone")  # the sender's deadline, after the word
    final = drive([decode], lambda: idle(decode))
    assert final[run.decode_id].token_ids == hf_reference(model_dirs["llama-gqa"], prompt, 8)
    assert worker.stats.sources_lost == 1 and worker.stats.sources_unreachable == 0
    assert worker.stats.recvs_failed == 1 and worker.stats.timeouts == 0
    assert_pool_clean(decode.block_pool)
    decode.close()
