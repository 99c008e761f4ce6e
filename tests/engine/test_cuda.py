"""CUDA paths of the engine. Skipped on CPU-only machines (see tests/conftest.py)."""

from __future__ import annotations

import pytest

from pdcluster.engine import LLM, SamplingParams
from tests.helpers import assert_pool_clean, count_calls
from tests.models import random_prompts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-tied-bias-mha"])
def test_cuda_float32_matches_transformers(variant, model_dirs, hf_reference):
    llm = LLM(model_dirs[variant], device="cuda", dtype="float32", num_kv_blocks=256,
              max_num_batched_tokens=64)
    prompts = random_prompts(8, 5, 80, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        assert out.token_ids == hf_reference(model_dirs[variant], prompt, 12)
    assert_pool_clean(llm.engine.block_pool)


def test_cuda_bfloat16_generates(model_dirs):
    llm = LLM(model_dirs["llama-gqa"], device="cuda", dtype="bfloat16")
    assert llm.engine.kv_cache.tensor.is_cuda
    outs = llm.generate(random_prompts(4, 10, 40, seed=12),
                        SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=8,
                                       ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in outs)
    assert_pool_clean(llm.engine.block_pool)


def test_cuda_shared_prefix_decodes_take_the_cascade_and_match(model_dirs, hf_reference,
                                                                monkeypatch):
    """The cascade split (engine/models/attention.py) off the CPU runs `_attend_matmul`."""
    from pdcluster.engine.models import attention

    calls = count_calls(monkeypatch, attention, "_attend_matmul")
    llm = LLM(model_dirs["llama-gqa"], device="cuda", dtype="float32", num_kv_blocks=128,
              block_size=4)
    prefix = random_prompts(1, 40, 40, seed=7)[0]
    prompts = [prefix + tail for tail in random_prompts(4, 1, 9, seed=8)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        assert out.token_ids == hf_reference(model_dirs["llama-gqa"], prompt, 10)
    assert calls
