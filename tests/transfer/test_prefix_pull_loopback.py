"""Global prefix reuse between real engines over the loopback fake transport: a node P pulls
the cached prefix of its prompt from a holder node H instead of computing it. Exact tokens
against transformers, the block counts on both sides, partial and stale hints, the threshold,
failures (dead holder, failed write, holder timeout), aborts, and a pull combined with a
send to a decode node; a leak check of every pool after each scenario."""

from __future__ import annotations

import pytest

from pdcluster.core.kv_transfer import PrefixPull, RemoteDecode, RemotePrefill
from pdcluster.engine import SamplingParams
from tests.helpers import assert_pool_clean
from tests.models import random_prompts
from tests.transfer.disagg import FakeClock, drive, idle, make_engine
from tests.transfer.loopback import LoopbackFabric

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 8


@pytest.fixture
def fabric():
    return LoopbackFabric()


@pytest.fixture
def model(model_dirs):
    return model_dirs["llama-gqa"]


@pytest.fixture
def nodes(model, fabric):
    """Holder H and requester P, and H's side-channel address."""
    h_transport, p_transport = fabric.transport(), fabric.transport()
    holder = make_engine(model, h_transport)
    puller = make_engine(model, p_transport)
    yield holder, puller, h_transport.reply_address
    for engine in (holder, puller):
        engine.close()


def run(*engines, **kw):
    return drive(list(engines), lambda: all(idle(e) for e in engines), **kw)


def serve(engine, prompt, request_id="warm", **kw):
    """Run `prompt` on `engine` alone, leaving its blocks in the prefix cache."""
    engine.add_request(request_id, prompt, GREEDY, **kw)
    return run(engine)[request_id]


def assert_clean(*engines):
    for engine in engines:
        assert_pool_clean(engine.block_pool)


def stats(engine):
    return engine.connector.worker.stats


def shared_prompts(seed: int, prefix_len: int = 48, tail_len: int = 20):
    prefix, tail_a, tail_b = random_prompts(3, prefix_len, prefix_len, seed=seed)
    return prefix + tail_a[:tail_len], prefix + tail_b[:tail_len]


def test_pulled_prefix_gives_exact_tokens(nodes, model, hf_reference):
    holder, puller, addr = nodes
    first, second = shared_prompts(seed=60)
    serve(holder, first)
    puller.add_request("p", second, GREEDY, prefix_pull=PrefixPull(addr, 6))
    out = run(holder, puller)["p"]
    assert out.token_ids == hf_reference(model, second, 8)
    assert out.num_cached_tokens == 6 * BLOCK
    assert stats(puller).pulls_ok == 1 and stats(puller).blocks_pulled == 6
    assert stats(holder).pull_requests_served == 1 and stats(holder).blocks_served == 6
    assert stats(holder).blocks_sent == 0  # the P -> D counters stay apart
    # The pulled blocks are now P's own prefix-cache hits.
    puller.add_request("again", second, GREEDY)
    assert run(puller)["again"].num_cached_tokens == 8 * BLOCK
    assert_clean(holder, puller)


def test_only_blocks_past_the_local_hit_are_pulled(nodes, model, hf_reference):
    holder, puller, addr = nodes
    first, second = shared_prompts(seed=61)
    serve(holder, first)
    serve(puller, second[:2 * BLOCK + 3])  # P holds blocks 0 and 1 itself
    puller.add_request("p", second, GREEDY, prefix_pull=PrefixPull(addr, 6))
    out = run(holder, puller)["p"]
    assert out.token_ids == hf_reference(model, second, 8)
    assert out.num_cached_tokens == 6 * BLOCK
    assert stats(puller).blocks_pulled == 4 and stats(holder).blocks_served == 4
    assert_clean(holder, puller)


def test_holder_sends_the_leading_run_it_still_has(nodes, model, hf_reference):
    holder, puller, addr = nodes
    first, second = shared_prompts(seed=62)
    serve(holder, first[:3 * BLOCK + 2])  # H caches 3 blocks; the hint claims 6
    puller.add_request("p", second, GREEDY, prefix_pull=PrefixPull(addr, 6))
    out = run(holder, puller)["p"]
    assert out.token_ids == hf_reference(model, second, 8)
    assert out.num_cached_tokens == 3 * BLOCK
    assert stats(puller).blocks_pulled == 3 and stats(puller).pulls_ok == 1
    assert_clean(holder, puller)


@pytest.mark.parametrize("salt", [None, "tenant-b"])
def test_stale_or_foreign_hint_computes_everything(nodes, model, hf_reference, salt):
    holder, puller, addr = nodes
    first, second = shared_prompts(seed=63)
    if salt:
        serve(holder, first, cache_salt="tenant-a")  # same tokens, another tenant's blocks
    puller.add_request("p", second, GREEDY, cache_salt=salt, prefix_pull=PrefixPull(addr, 6))
    out = run(holder, puller)["p"]
    assert out.token_ids == hf_reference(model, second, 8)
    assert out.num_cached_tokens == 0
    assert stats(puller).pulls_ok == 1 and stats(puller).blocks_pulled == 0
    assert stats(holder).blocks_served == 0
    assert_clean(holder, puller)


def test_hint_below_the_threshold_is_ignored(nodes, model, hf_reference):
    holder, puller, addr = nodes
    first, second = shared_prompts(seed=64)
    serve(holder, first)
    serve(puller, second[:5 * BLOCK + 1])  # P holds 5 of the 6 blocks: pulling 1 < 2
    puller.add_request("p", second, GREEDY, prefix_pull=PrefixPull(addr, 6))
    puller.add_request("q", first, GREEDY, prefix_pull=PrefixPull(addr, 1))
    final = run(holder, puller)
    assert final["p"].token_ids == hf_reference(model, second, 8)
    assert final["q"].token_ids == hf_reference(model, first, 8)
    assert stats(puller).pulls_ok + stats(puller).pulls_failed == 0
    assert stats(holder).pull_requests_served == 0
    assert_clean(holder, puller)


def test_never_pulls_the_block_holding_the_last_prompt_token(nodes, model, hf_reference):
    holder, puller, addr = nodes
    prompt = random_prompts(1, 4 * BLOCK, 4 * BLOCK, seed=65)[0]  # exactly 4 blocks
    serve(holder, prompt)
    puller.add_request("p", prompt, GREEDY, prefix_pull=PrefixPull(addr, 4))
    out = run(holder, puller)["p"]
    assert out.token_ids == hf_reference(model, prompt, 8)
    assert stats(puller).blocks_pulled == 3 and out.num_cached_tokens == 3 * BLOCK
    assert_clean(holder, puller)


def test_silent_holder_times_out_and_puller_computes(model, fabric, hf_reference):
    clock = FakeClock()
    h_transport, p_transport = fabric.transport(), fabric.transport()
    fabric.drop_messages_to.add(h_transport.reply_address)
    holder = make_engine(model, h_transport, clock=clock, timeout_s=2)
    puller = make_engine(model, p_transport, clock=clock, timeout_s=2)
    first, second = shared_prompts(seed=66)
    serve(holder, first)
    puller.add_request("p", second, GREEDY,
                       prefix_pull=PrefixPull(h_transport.reply_address, 6))
    drive([puller], lambda: bool(puller.scheduler.waiting_for_remote))
    clock.now += 3
    out = run(holder, puller)["p"]
    assert out.token_ids == hf_reference(model, second, 8)
    assert out.num_cached_tokens == 0
    assert stats(puller).timeouts == 1 and stats(puller).pulls_failed == 1
    assert_clean(holder, puller)


def test_failed_write_falls_back_to_compute(nodes, fabric, model, hf_reference):
    holder, puller, addr = nodes
    first, second = shared_prompts(seed=67)
    serve(holder, first)
    fabric.fail_writes = True
    puller.add_request("p", second, GREEDY, prefix_pull=PrefixPull(addr, 6))
    out = run(holder, puller)["p"]
    assert out.token_ids == hf_reference(model, second, 8)
    assert stats(holder).pull_serves_failed == 1 and stats(puller).pulls_failed == 1
    assert_clean(holder, puller)


def test_holder_that_does_not_step_expires_the_pull(model, fabric, hf_reference):
    clock = FakeClock()
    h_transport, p_transport = fabric.transport(), fabric.transport()
    holder = make_engine(model, h_transport, clock=clock, timeout_s=2)
    puller = make_engine(model, p_transport, clock=clock, timeout_s=10)
    first, second = shared_prompts(seed=68)
    serve(holder, first)
    puller.add_request("p", second, GREEDY,
                       prefix_pull=PrefixPull(h_transport.reply_address, 6))
    drive([puller], lambda: holder.has_pinned_blocks())  # H got the pull, has not stepped
    clock.now += 3
    # H's next step expires the pull (answered as failed), then resolves its lookup: the
    # blocks it references for the late serve are released without a write.
    out = run(holder, puller)["p"]
    assert out.token_ids == hf_reference(model, second, 8)
    assert stats(holder).timeouts == 1 and stats(puller).pulls_failed == 1
    assert stats(holder).pull_requests_served == 0
    assert_clean(holder, puller)


def test_abort_while_pulling_releases_both_sides(nodes, fabric):
    holder, puller, addr = nodes
    first, second = shared_prompts(seed=69)
    serve(holder, first)
    puller.add_request("p", second, GREEDY, prefix_pull=PrefixPull(addr, 6))
    puller.step()
    assert puller.scheduler.waiting_for_remote
    assert puller.abort_request("p")
    assert puller.has_pinned_blocks()  # H may be writing: held until it answers
    run(holder, puller)
    assert_clean(holder, puller)


def test_pull_then_send_to_a_decode_node(model, fabric, hf_reference):
    h_t, p_t, d_t = fabric.transport(), fabric.transport(), fabric.transport()
    holder, prefill, decode = (make_engine(model, t) for t in (h_t, p_t, d_t))
    try:
        first, second = shared_prompts(seed=70)
        serve(holder, first)
        decode.add_request("d", second, GREEDY,
                           kv_transfer=RemotePrefill("t-1", p_t.reply_address),
                           prefix_pull=PrefixPull(h_t.reply_address, 6))  # ignored on D
        prefill.add_request("p", second, SamplingParams(temperature=0, max_tokens=1),
                            kv_transfer=RemoteDecode("t-1"),
                            prefix_pull=PrefixPull(h_t.reply_address, 6))
        final = run(holder, prefill, decode)
        expected = hf_reference(model, second, 8)
        assert final["d"].token_ids == expected and final["p"].token_ids == expected[:1]
        assert stats(prefill).blocks_pulled == 6 and stats(holder).blocks_served == 6
        assert stats(prefill).blocks_sent == 9 and stats(decode).recvs_ok == 1
        assert stats(decode).pulls_ok + stats(decode).pulls_failed == 0
        assert_clean(holder, prefill, decode)
    finally:
        for engine in (holder, prefill, decode):
            engine.close()
