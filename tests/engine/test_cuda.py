"""CUDA paths of the engine: the Triton kernels, the varlen prefill, CUDA graphs of decode
steps, the cascade on the GPU, and every family's eager fallback. Skipped on CPU-only machines
(see tests/conftest.py); tests/engine/test_gpu_path.py runs the same kernels and graph buffers
on CPU through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from pdcluster.engine import LLM, SamplingParams
from pdcluster.engine.runner.cuda_graphs import DecodeGraphs
from tests.helpers import assert_pool_clean, count_calls
from tests.models import random_prompts

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _assert_matches(llm: LLM, model: str, hf_reference, prompts, params=GREEDY) -> None:
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        assert out.token_ids == hf_reference(model, prompt, params.max_tokens)
    assert_pool_clean(llm.engine.block_pool)


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-tied-bias-mha",
                                     "llama-mqa-headdim-llama3rope", "qwen3-headdim"])
def test_cuda_float32_with_graphs_matches_transformers(variant, model_dirs, hf_reference,
                                                       monkeypatch):
    replays = count_calls(monkeypatch, DecodeGraphs, "replay")
    llm = LLM(model_dirs[variant], device="cuda", dtype="float32", num_kv_blocks=256,
              max_num_batched_tokens=64, max_num_seqs=8)
    assert llm.engine.uses_cuda_graphs
    _assert_matches(llm, model_dirs[variant], hf_reference, random_prompts(8, 5, 80, seed=11))
    assert replays, "no decode step replayed a graph"
    assert llm.engine.runner.lookahead.num_taken, "no decode step was launched ahead"


def test_cuda_look_ahead_changes_no_token_and_every_launch_is_taken(model_dirs, hf_reference):
    """Decode steps launched ahead on real graphs, with the host racing the device: the same
    tokens as the engine without look-ahead (engine/runner/lookahead.py)."""
    from tests.engine.test_lookahead import assert_same_runs, mixed_run, mixed_stop_token

    model = model_dirs["llama-gqa"]
    stop_token = mixed_stop_token(model, hf_reference)
    runs = []
    for overlap in (True, False):
        llm = LLM(model, device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=8,
                  overlap_decode=overlap)
        assert llm.engine.uses_cuda_graphs
        runs.append(mixed_run(llm, stop_token))
    assert_same_runs(*runs)
    assert torch.isfinite(llm.engine.kv_cache.tensor).all()


def test_cuda_enforce_eager_takes_no_graphs_and_matches(model_dirs, hf_reference, monkeypatch):
    replays = count_calls(monkeypatch, DecodeGraphs, "replay")
    llm = LLM(model_dirs["llama-gqa"], device="cuda", dtype="float32", num_kv_blocks=256,
              enforce_eager=True)
    assert not llm.engine.uses_cuda_graphs and llm.engine.runner.graphs is None
    _assert_matches(llm, model_dirs["llama-gqa"], hf_reference, random_prompts(5, 3, 60, seed=3))
    assert not replays


@pytest.mark.parametrize("variant", ["deepseek-v2-qlora-grouped", "deepseek-v3-yarn-shared2"])
def test_cuda_mla_decodes_in_graphs_over_the_latent_cache_and_matches(model_dirs, hf_reference,
                                                                      monkeypatch, variant):
    """DeepSeek's absorbed decode reads the latent cache in place (the paged kernel, its
    heads the rows of one KV head), so its decode steps replay graphs, launched ahead."""
    replays = count_calls(monkeypatch, DecodeGraphs, "replay")
    llm = LLM(model_dirs[variant], device="cuda", dtype="float32", num_kv_blocks=256,
              max_num_seqs=8)
    assert llm.engine.uses_cuda_graphs
    _assert_matches(llm, model_dirs[variant], hf_reference, random_prompts(4, 5, 40, seed=5))
    assert replays and llm.engine.runner.lookahead.num_taken


@pytest.mark.parametrize("variant", ["mixtral-4x2", "qwen3moe-8x3-norm-dense0"])
def test_cuda_moe_decodes_in_graphs_with_its_experts_grouped_on_the_device(
        model_dirs, hf_reference, monkeypatch, variant):
    """Mixtral, and Qwen3-MoE (top-3, q/k norms, a dense first layer): routing and experts
    without a host sync (engine/kernels/gpu/fused_moe.py), so its decode steps replay
    graphs."""
    from pdcluster.engine.kernels import gpu

    grouped = count_calls(monkeypatch, gpu.ops(), "moe_experts")
    replays = count_calls(monkeypatch, DecodeGraphs, "replay")
    llm = LLM(model_dirs[variant], device="cuda", dtype="float32", num_kv_blocks=256,
              max_num_seqs=8)
    assert llm.engine.uses_cuda_graphs
    grouped.clear()  # capture ran them
    _assert_matches(llm, model_dirs[variant], hf_reference,
                    random_prompts(4, 5, 40, seed=5))
    assert replays and grouped


def test_cuda_bfloat16_generates(model_dirs):
    llm = LLM(model_dirs["llama-gqa"], device="cuda", dtype="bfloat16")
    assert llm.engine.kv_cache.tensor.is_cuda and llm.engine.uses_cuda_graphs
    outs = llm.generate(random_prompts(4, 10, 40, seed=12),
                        SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=8,
                                       ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in outs)
    assert_pool_clean(llm.engine.block_pool)


def test_cuda_shared_prefix_decodes_take_the_cascade_and_match(model_dirs, hf_reference,
                                                                monkeypatch):
    """Eager steps split decode attention at the blocks every sequence shares (the Triton
    kernel's log-sum-exps merged on the GPU)."""
    from pdcluster.engine.models import attention

    merges = count_calls(monkeypatch, attention, "_merge")
    llm = LLM(model_dirs["llama-gqa"], device="cuda", dtype="float32", num_kv_blocks=128,
              block_size=4, enforce_eager=True)
    prefix = random_prompts(1, 40, 40, seed=7)[0]
    prompts = [prefix + tail for tail in random_prompts(4, 1, 9, seed=8)]
    _assert_matches(llm, model_dirs["llama-gqa"], hf_reference, prompts,
                    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert merges


def test_cuda_long_prompts_chunked_with_prefix_hits_match(model_dirs, hf_reference):
    """Chunks after a cached prefix and after earlier chunks, starting mid-block, in one
    varlen launch with decodes in the same step."""
    llm = LLM(model_dirs["llama-gqa"], device="cuda", dtype="float32", num_kv_blocks=512,
              block_size=16, max_num_batched_tokens=100)
    prefix = random_prompts(1, 150, 150, seed=9)[0]
    prompts = [prefix + tail for tail in random_prompts(3, 20, 200, seed=10)]
    prompts += random_prompts(3, 300, 400, seed=13)
    _assert_matches(llm, model_dirs["llama-gqa"], hf_reference, prompts)
