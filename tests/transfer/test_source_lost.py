"""`ConnectorWorker.fail_receive`: a decode node told that its prefill node died gives up on
the KV at once and recomputes the prompt (exact tokens), long before its KV timeout, with
nothing leaked; a late answer from the dead transfer changes nothing. A source the side
channel cannot reach fails the receive at once (`sources_unreachable`), and when the
router's word comes too, whichever is first fails it — once."""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.core.kv_transfer import XferDone
from pdcluster.engine import LLMEngine, SamplingParams
from tests.helpers import assert_pool_clean
from tests.models import random_prompts
from tests.transfer.disagg import DisaggRun, FakeClock, drive, idle, make_engine, submit
from tests.transfer.loopback import LoopbackFabric

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@dataclass(slots=True)
class LoneDecode:
    """A decode node whose request's KV is to come from a prefill node that never answers
    (`fault`: "drop" its messages silently, as a stopped node; "refuse" them, as a dead one);
    its clock never moves, so no KV timeout ever fires."""

    fabric: LoopbackFabric
    decode: LLMEngine
    prompt: list[int]
    run: DisaggRun

    @classmethod
    def start(cls, model_dir: str, seed: int, fault: str) -> LoneDecode:
        fabric = LoopbackFabric()
        p_transport, d_transport = fabric.transport(), fabric.transport()
        faulty = {"drop": fabric.drop_messages_to, "refuse": fabric.refuse_messages_to}
        faulty[fault].add(p_transport.reply_address)
        decode = make_engine(model_dir, d_transport, clock=FakeClock(), timeout_s=30)
        prompt = random_prompts(1, 30, 30, seed=seed)[0]
        return cls(fabric, decode, prompt, submit(None, decode, prompt, GREEDY,
                                                  p_transport.reply_address))


def test_a_lost_source_is_recomputed_at_once(model_dirs, hf_reference):
    lone = LoneDecode.start(model_dirs["llama-gqa"], seed=90, fault="drop")  # P never answers
    decode, run = lone.decode, lone.run
    for _ in range(3):
        decode.step()
    assert decode.scheduler.waiting_for_remote and decode.connector.worker.num_pending_receives

    worker = decode.connector.worker
    assert worker.fail_receive(run.transfer_id, "prefill node lost: p0 disconnected")
    assert not worker.fail_receive(run.transfer_id, "again")  # already given up
    final = drive([decode], lambda: idle(decode))

    assert final[run.decode_id].token_ids == hf_reference(model_dirs["llama-gqa"], lone.prompt, 8)
    assert worker.stats.sources_lost == 1 and worker.stats.timeouts == 0
    # the dead transfer's answer, should one still come, is only counted as late
    worker.transport.deliver(XferDone(run.transfer_id, True, first_token=5))
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
    lone = LoneDecode.start(model_dirs["llama-gqa"], seed=92, fault="drop")
    decode, run = lone.decode, lone.run
    worker = decode.connector.worker
    # told before its first step: the request is still queued, no receive has started
    assert not worker.fail_receive(run.transfer_id, "prefill node lost: p0: overloaded")
    final = drive([decode], lambda: idle(decode))
    assert final[run.decode_id].token_ids == hf_reference(model_dirs["llama-gqa"], lone.prompt, 8)
    assert worker.stats.sources_lost == 1 and worker.stats.timeouts == 0
    lone.fabric.flush()
    assert not lone.fabric.dropped_handlers  # P was never even asked
    assert_pool_clean(decode.block_pool)
    decode.close()


def test_an_unreachable_source_fails_the_receive_at_once(model_dirs, hf_reference):
    lone = LoneDecode.start(model_dirs["llama-gqa"], seed=93, fault="refuse")  # P is gone
    decode, run = lone.decode, lone.run
    worker = decode.connector.worker
    final = drive([decode], lambda: idle(decode))
    assert final[run.decode_id].token_ids == hf_reference(model_dirs["llama-gqa"], lone.prompt, 8)
    assert worker.stats.sources_unreachable == 1 and worker.stats.recvs_failed == 1
    assert worker.stats.sources_lost == 0 and worker.stats.timeouts == 0
    # the router's word, coming after, finds nothing left to fail
    assert not worker.fail_receive(run.transfer_id, "prefill node lost: p0 disconnected")
    assert worker.stats.sources_lost == 0 and worker.stats.recvs_failed == 1
    assert_pool_clean(decode.block_pool)
    decode.close()


def test_the_routers_word_first_leaves_nothing_for_the_transport_to_fail(model_dirs,
                                                                         hf_reference):
    lone = LoneDecode.start(model_dirs["llama-gqa"], seed=94, fault="drop")  # a stopped P
    decode, run = lone.decode, lone.run
    for _ in range(3):
        decode.step()
    worker = decode.connector.worker
    assert worker.fail_receive(run.transfer_id, "prefill node lost: p0 disconnected")
    lone.fabric.flush()
    assert len(lone.fabric.dropped_handlers) == 1  # the request to P, never delivered
    lone.fabric.dropped_handlers[0]("the peer is gone")  # the sender's deadline, after the word
    final = drive([decode], lambda: idle(decode))
    assert final[run.decode_id].token_ids == hf_reference(model_dirs["llama-gqa"], lone.prompt, 8)
    assert worker.stats.sources_lost == 1 and worker.stats.sources_unreachable == 0
    assert worker.stats.recvs_failed == 1 and worker.stats.timeouts == 0
    assert_pool_clean(decode.block_pool)
    decode.close()
