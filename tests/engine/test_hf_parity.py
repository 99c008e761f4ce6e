"""Greedy outputs must be token-for-token identical to transformers' `generate`, for every
model variant and every way the engine can split the work: batching, prefix-cache hits,
chunked prefill (chunks ending mid-block), and preemption under a tiny KV pool."""

from __future__ import annotations

import pytest

from pdcluster.engine import LLM, SamplingParams
from tests.helpers import assert_pool_clean
from tests.models import MODEL_VARIANTS, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
VARIANTS = list(MODEL_VARIANTS)
# One variant per family built by transformers (tests/hf_tiny.py) joins the chunked-prefill and
# preemption cases; a 13-token budget splits 16-token blocks mid-block.
FAMILIES = ["qwen3-headdim", "mixtral-4x2", "qwen3moe-8x3-norm-dense0",
            "deepseek-v2-qlora-grouped", "deepseek-v3-yarn-shared2"]
CHUNKED = [(v, b) for v in ("llama-gqa", "qwen2-tied-bias-mha") for b in (5, 13, 40)]
CHUNKED += [(v, 13) for v in FAMILIES]


def assert_matches_hf(llm, model_dir, prompts, hf_reference, params=GREEDY):
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        expected = hf_reference(model_dir, prompt, params.max_tokens)
        assert out.token_ids == expected, f"diverged for a {len(prompt)}-token prompt"
    assert_pool_clean(llm.engine.block_pool)
    return outs


@pytest.mark.parametrize("variant", VARIANTS)
def test_single_prompt(variant, model_dirs, hf_reference):
    llm = LLM(model_dirs[variant], num_kv_blocks=64)
    assert_matches_hf(llm, model_dirs[variant], random_prompts(1, 20, 20, seed=1), hf_reference)


@pytest.mark.parametrize("variant", VARIANTS)
def test_batch_of_16_mixed_lengths(variant, model_dirs, hf_reference):
    llm = LLM(model_dirs[variant], num_kv_blocks=256)
    prompts = random_prompts(16, 1, 90, seed=2)
    assert_matches_hf(llm, model_dirs[variant], prompts, hf_reference)


@pytest.mark.parametrize("variant", VARIANTS)
def test_shared_prefix_hits_change_nothing(variant, model_dirs, hf_reference):
    llm = LLM(model_dirs[variant], num_kv_blocks=256, block_size=8)
    prefix = random_prompts(1, 70, 70, seed=3)[0]
    prompts = [prefix + tail for tail in random_prompts(6, 1, 20, seed=4)]
    assert_matches_hf(llm, model_dirs[variant], prompts[:1], hf_reference)
    outs = assert_matches_hf(llm, model_dirs[variant], prompts[1:], hf_reference)
    assert all(out.num_cached_tokens >= 64 for out in outs), [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("variant, budget", CHUNKED)
def test_chunked_prefill_mid_block(variant, budget, model_dirs, hf_reference):
    llm = LLM(model_dirs[variant], num_kv_blocks=128, block_size=16,
              max_num_batched_tokens=budget)
    prompts = random_prompts(5, 17, 75, seed=5)
    assert_matches_hf(llm, model_dirs[variant], prompts, hf_reference)


@pytest.mark.parametrize("variant", ["llama-gqa", "mistral-linear-rope", *FAMILIES])
def test_preemption_under_a_tiny_pool(variant, model_dirs, hf_reference):
    llm = LLM(model_dirs[variant], num_kv_blocks=14, block_size=4, max_num_batched_tokens=32)
    prompts = random_prompts(8, 6, 30, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    assert_matches_hf(llm, model_dirs[variant], prompts, hf_reference, params)
    assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_caching_disabled_still_matches(model_dirs, hf_reference):
    llm = LLM(model_dirs["llama-gqa"], num_kv_blocks=64, enable_prefix_caching=False)
    prompt = random_prompts(1, 40, 40, seed=7)
    assert_matches_hf(llm, model_dirs["llama-gqa"], prompt * 2, hf_reference)
    assert not llm.engine.block_pool.cached_block_map


def test_eos_stops_like_transformers(model_dirs, hf_reference):
    """Without ignore_eos, generation ends at the first EOS the reference produces."""
    model_dir = model_dirs["llama-gqa"]
    llm = LLM(model_dir, num_kv_blocks=64)
    prompt = random_prompts(1, 12, 12, seed=8)[0]
    reference = hf_reference(model_dir, prompt, 8)
    eos = reference[3]  # pretend the 4th greedy token is the end-of-sequence token
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                stop_token_ids=[eos]))[0]
    assert out.token_ids == reference[: reference.index(eos) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == eos


@pytest.mark.parametrize("variant", ["deepseek-v2-qlora-grouped", "deepseek-v3-yarn-shared2"])
def test_mla_decode_without_absorption_matches_too(variant, model_dirs, hf_reference):
    """The expanded decode form (what the absorbed one replaces) gives the same tokens."""
    llm = LLM(model_dirs[variant], num_kv_blocks=256)
    for layer in llm.engine.runner.model.layers:
        layer.self_attn.absorb_decode = False
    assert_matches_hf(llm, model_dirs[variant], random_prompts(6, 1, 40, seed=9), hf_reference)
