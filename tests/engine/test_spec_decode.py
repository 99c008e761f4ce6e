"""Speculative decoding in the engine: greedy output token for token equal to transformers
(and to plain decoding) under every verification outcome — a proposer with planted mistakes,
a draft model, n-gram lookup — across batching, preemption, prefix hits and chunked prefill;
requests that finish inside a verified run stop exactly; logprobs of accepted tokens; stop
strings; and the sampled distribution against the target's exact one. Leak check (the target
pool and the draft pool) after every scenario."""

from __future__ import annotations

import pytest

from pdcluster.engine import LLM, SamplingParams
from tests.engine.spec_fakes import OracleProposer, use_proposer
from tests.helpers import assert_pool_clean
from tests.models import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
K = 3


def oracle_llm(model_dir, hf_reference, prompts, params=GREEDY, **options) -> LLM:
    """An engine whose proposer knows the reference continuations, with planted mistakes."""
    llm = LLM(model_dir, speculative=f"ngram:k={K}", **options)
    truth = {tuple(p): hf_reference(model_dir, p, params.max_tokens) for p in prompts}
    use_proposer(llm, OracleProposer(truth, K, llm.engine.model_config.vocab_size))
    return llm


def assert_spec_matches_hf(llm, model_dir, prompts, hf_reference, params=GREEDY):
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_reference(model_dir, prompt, params.max_tokens)
    assert_clean(llm)
    return outs


def assert_clean(llm) -> None:
    assert_pool_clean(llm.engine.block_pool)
    proposer = llm.engine.spec_decoder.proposer
    if hasattr(proposer, "block_pool"):
        assert_pool_clean(proposer.block_pool)
        assert not proposer._shadows


def assert_mixed_outcomes(llm) -> None:
    """Verifications happened, some fully accepted and some not."""
    stats = llm.engine.spec_decode_stats()
    assert stats.num_verifications > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-tied-bias-mha",
                                     "deepseek-v2-qlora-grouped", "mixtral-4x2"])
def test_batch_matches_transformers(variant, model_dirs, hf_reference):
    prompts = random_prompts(12, 1, 70, seed=2)
    llm = oracle_llm(model_dirs[variant], hf_reference, prompts, num_kv_blocks=256)
    assert_spec_matches_hf(llm, model_dirs[variant], prompts, hf_reference)
    assert_mixed_outcomes(llm)


def test_preemption_under_a_tiny_pool(model_dirs, hf_reference):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = random_prompts(8, 6, 30, seed=6)
    llm = oracle_llm(model_dirs["llama-gqa"], hf_reference, prompts, params,
                     num_kv_blocks=14, block_size=4, max_num_batched_tokens=32)
    assert_spec_matches_hf(llm, model_dirs["llama-gqa"], prompts, hf_reference, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_mixed_outcomes(llm)


def test_prefix_hits_and_chunked_prefill(model_dirs, hf_reference):
    model_dir = model_dirs["llama-gqa"]
    prefix = random_prompts(1, 70, 70, seed=3)[0]
    prompts = [prefix + tail for tail in random_prompts(6, 1, 20, seed=4)]
    llm = oracle_llm(model_dir, hf_reference, prompts, num_kv_blocks=256, block_size=8,
                     max_num_batched_tokens=13)
    assert_spec_matches_hf(llm, model_dir, prompts[:1], hf_reference)
    outs = assert_spec_matches_hf(llm, model_dir, prompts[1:], hf_reference)
    assert all(out.num_cached_tokens >= 64 for out in outs)
    assert_mixed_outcomes(llm)


def test_blocks_of_accepted_tokens_are_cached(model_dirs, hf_reference):
    """A second request over the first one's prompt + output hits every full block that
    accepted tokens completed (their hashes went in as the run was accepted)."""
    model_dir = model_dirs["llama-gqa"]
    prompt = random_prompts(1, 5, 5, seed=11)[0]
    params = SamplingParams(temperature=0.0, max_tokens=27, ignore_eos=True)
    llm = oracle_llm(model_dir, hf_reference, [prompt], params, num_kv_blocks=64,
                     block_size=4)
    out = assert_spec_matches_hf(llm, model_dir, [prompt], hf_reference, params)[0]
    follow_up = prompt + out.token_ids + [7]
    again = llm.generate([follow_up], SamplingParams(temperature=0.0, max_tokens=1))[0]
    # Every full block but the one holding the last output token (never computed).
    assert again.num_cached_tokens == (len(prompt) + len(out.token_ids) - 1) // 4 * 4 == 28
    assert_clean(llm)


@pytest.mark.parametrize("draft", ["llama-gqa", "llama-yarn-tied"])
def test_draft_model(draft, model_dirs, hf_reference):
    """The target itself as draft (everything accepted) and another model with the same
    vocabulary (nearly nothing accepted): both exact, draft blocks all returned."""
    model_dir = model_dirs["llama-gqa"]
    llm = LLM(model_dir, num_kv_blocks=96, block_size=8,
              speculative=f"draft:{model_dirs[draft]},k=4")
    prompts = random_prompts(6, 1, 40, seed=12)
    assert_spec_matches_hf(llm, model_dir, prompts, hf_reference)
    stats = llm.engine.spec_decode_stats()
    assert stats.num_verifications > 0
    assert (stats.acceptance_rate == 1.0) == (draft == "llama-gqa")


def test_draft_model_under_preemption(model_dirs, hf_reference):
    model_dir = model_dirs["llama-gqa"]
    llm = LLM(model_dir, num_kv_blocks=14, block_size=4, max_num_batched_tokens=32,
              speculative=f"draft:{model_dir},k=3")
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    assert_spec_matches_hf(llm, model_dir, random_prompts(8, 6, 30, seed=6), hf_reference,
                           params)
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("cut", ["stop_token", "max_tokens", "min_tokens"])
def test_finishing_inside_a_verified_run(cut, model_dirs, hf_reference):
    """The oracle proposes the true continuation; the request must still end exactly where
    plain decoding ends it."""
    model_dir = model_dirs["llama-gqa"]
    prompt = random_prompts(1, 12, 12, seed=8)[0]
    ref = hf_reference(model_dir, prompt, 12)
    params = {"stop_token": SamplingParams(temperature=0, max_tokens=12,
                                           stop_token_ids=[ref[5]]),
              "max_tokens": SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              "min_tokens": SamplingParams(temperature=0, max_tokens=12, min_tokens=8,
                                           stop_token_ids=[ref[2], ref[6]])}[cut]
    plain = LLM(model_dir, num_kv_blocks=64).generate([prompt], params)[0]
    llm = LLM(model_dir, num_kv_blocks=64, speculative=f"ngram:k={K + 2}")
    use_proposer(llm, OracleProposer({tuple(prompt): ref}, K + 2, 32000))
    out = llm.generate([prompt], params)[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (
        plain.token_ids, plain.finish_reason, plain.stop_reason)
    assert llm.engine.spec_decode_stats().num_verifications > 0
    assert_clean(llm)


def test_logprobs_of_accepted_tokens(model_dirs, hf_reference):
    model_dir = model_dirs["llama-gqa"]
    prompts = random_prompts(4, 5, 30, seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    plain = LLM(model_dir, num_kv_blocks=64).generate(prompts, params)
    llm = oracle_llm(model_dir, hf_reference, prompts, params, num_kv_blocks=64)
    for a, b in zip(plain, llm.generate(prompts, params), strict=True):
        assert a.token_ids == b.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
        assert [[t for t, _ in top] for top in a.top_logprobs] == [
            [t for t, _ in top] for top in b.top_logprobs]
    assert_mixed_outcomes(llm)
    assert_clean(llm)


def test_stop_string_inside_a_verified_run(model_dirs, hf_reference):
    model_dir = model_dirs["llama-gqa"]
    prompt = random_prompts(1, 10, 10, seed=14)[0]
    ref = hf_reference(model_dir, prompt, 12)
    base = LLM(model_dir, num_kv_blocks=64)
    text = base.engine.tokenizer.decode(ref[:6])
    stop = text[-3:].strip() or text[-4:]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    plain = base.generate([prompt], params)[0]
    llm = LLM(model_dir, num_kv_blocks=64, speculative="ngram:k=5")
    use_proposer(llm, OracleProposer({tuple(prompt): ref}, 5, 32000))
    out = llm.generate([prompt], params)[0]
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == (
        plain.token_ids, plain.text, plain.finish_reason, plain.stop_reason)
    assert out.finish_reason == "stop"
    assert_clean(llm)


@pytest.mark.parametrize("shaping", [{"logit_bias": {7: 100.0}}, {"repetition_penalty": 1.5},
                                     {"presence_penalty": 1.0}, {"frequency_penalty": 0.5}])
def test_requests_shaping_their_logits_decode_without_drafts(shaping, model_dirs):
    """Verification re-derives only temperature/top-k/top-p/min_tokens, so penalties and
    logit_bias requests are never speculated: with the target as its own draft (everything a
    plain request drafts is accepted), they still give the plain engine's tokens."""
    model_dir = model_dirs["llama-gqa"]
    prompts = random_prompts(3, 1, 40, seed=14)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **shaping)
    plain = LLM(model_dir, num_kv_blocks=96, block_size=8).generate(prompts, params)
    llm = LLM(model_dir, num_kv_blocks=96, block_size=8, speculative=f"draft:{model_dir},k=4")
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert llm.engine.spec_decode_stats().num_verifications == 0
    assert_clean(llm)
