"""The engine's CUDA path end to end on a machine without a GPU: every tensor is handed to the
Triton kernels (engine/kernels/gpu), which Triton's interpreter runs on CPU — attention in place
for decodes, one varlen prefill launch per step, the fused layer ops — and decode steps go
through the CUDA graphs' static buffers (engine/runner/cuda_graphs.py) with padding rows written
to the scratch block. Greedy float32 tokens must equal transformers'. On a GPU machine the same
paths run for real in tests/engine/test_cuda.py."""

from __future__ import annotations

import collections

import pytest
import torch

from pdcluster.engine import LLM, SamplingParams, kernels
from pdcluster.engine.kernels import gpu
from pdcluster.engine.models import mla
from pdcluster.engine.models.mla import MLAttention
from pdcluster.engine.runner import cuda_graphs
from pdcluster.engine.runner.cuda_graphs import DecodeGraphs
from tests.helpers import assert_pool_clean, count_calls
from tests.models import random_prompts
from tests.triton_kernels import kernel_launches, triton_ops

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="on a GPU machine tests/engine/test_cuda.py runs this path")


@pytest.fixture
def kernel_calls(monkeypatch):
    """The GPU kernels serve every tensor; the CPU C++ ops are off (so nothing bypasses
    them). Returns the recorded calls of each Triton entry point."""
    ops = triton_ops()
    monkeypatch.setattr(gpu, "serves", lambda *tensors: bool(tensors))
    monkeypatch.setattr(kernels, "ops_for", lambda *tensors: None)
    return {name: count_calls(monkeypatch, ops, name)
            for name in ("paged_attention", "prefill_attention", "rope_and_cache_",
                         "add_rms_norm_")}


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen3-headdim"])
def test_chunked_prefill_and_decode_through_the_gpu_kernels_match_transformers(
        model_dirs, hf_reference, kernel_calls, variant):
    """Small on purpose: the interpreter runs each kernel program in Python. Qwen3's q/k
    norms run inside the RoPE kernel."""
    model = model_dirs[variant]
    llm = LLM(model, device="cpu", dtype="float32", num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=16)
    prefix = random_prompts(1, 13, 13, seed=21)[0]  # 3 blocks and a bit: hits start mid-block
    prompts = random_prompts(2, 5, 20, seed=22) + [prefix + [5, 6], prefix + [7, 8, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        assert out.token_ids == hf_reference(model, prompt, 4)
    assert all(kernel_calls.values()), {k: len(v) for k, v in kernel_calls.items()}
    assert_pool_clean(llm.engine.block_pool)


def test_decode_steps_through_the_graph_buffers_with_padding_match_transformers(
        model_dirs, hf_reference, kernel_calls, monkeypatch):
    """3 sequences in the bucket of 4: the padding row writes to the scratch block and
    changes no token."""
    model = model_dirs["llama-gqa"]
    llm = LLM(model, device="cpu", dtype="float32", num_kv_blocks=64, block_size=8)
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, max_batch=5, max_model_len=128)
    assert runner.graphs.buckets == [1, 2, 4, 5]
    replays = count_calls(monkeypatch, DecodeGraphs, "replay")
    prompts = random_prompts(3, 9, 16, seed=23)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        assert out.token_ids == hf_reference(model, prompt, 5)
    assert replays, "no decode step went through the graphs' buffers"
    scratch = runner.kv_cache._allocation[-1]
    assert scratch.abs().sum() > 0, "the padding row wrote nowhere visible"
    assert_pool_clean(llm.engine.block_pool)


GEMMS = {"linear", "mm", "addmm", "_linear_pointwise"}
ATTENTION_LAUNCHES = {"gemm": 2, "_rms_norm_kernel": 2, "_rope_and_cache_kernel": 1,
                      "_decode_split_kernel": 1, "_decode_merge_kernel": 1}
DENSE_LAUNCHES = {"gemm": 2, "_silu_and_mul_kernel": 1}
# the router, the pairs' layout, the experts' two kernels, the pairs' rows zeroed (a pair on
# another rank's experts adds nothing) and summed per token
MOE_LAUNCHES = {"_route_kernel": 1, "_layout_kernel": 1, "_gate_up_kernel": 1, "zeros": 1,
                "_down_kernel": 1, "sum": 1}


@pytest.mark.parametrize(("variant", "mlp", "per_layer"), [
    ("llama-gqa", DENSE_LAUNCHES, 10), ("qwen3-headdim", DENSE_LAUNCHES, 10),
    ("mixtral-4x2", MOE_LAUNCHES, 13)])
def test_a_decode_step_keeps_to_its_launch_budget(model_dirs, kernel_calls, variant, mlp,
                                                  per_layer):
    """The launch budget of a layer in a captured decode step: the input norm (with the
    residual add), the q/k/v GEMM, RoPE with the cache write, attention (split, merge), the
    output GEMM, the post-attention norm (with the add), then a dense MLP's gate/up GEMM,
    SwiGLU and down GEMM, or an MoE layer's six. On a GPU each launch costs a few
    microseconds even inside a graph, about as long as a small model's layer takes to read
    its weights: a stray elementwise op (a cast, a rescale) shows up here before it shows up
    as time. Qwen3's q/k norms are in the RoPE kernel's launch."""
    llm = LLM(model_dirs[variant], device="cpu", dtype="float32", num_kv_blocks=16,
              block_size=8)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_cache, max_batch=2, max_model_len=64)
    layers = runner.model.config.num_layers
    with kernel_launches() as launched:
        graphs._forward(2)
    kinds = collections.Counter({("gemm" if name in GEMMS else name): n
                                 for name, n in launched.items()})
    layer = collections.Counter(ATTENTION_LAUNCHES) + collections.Counter(mlp)
    assert layer.total() == per_layer
    want = collections.Counter({k: n * layers for k, n in layer.items()})
    # around the layers: the embedding, the final norm, the LM head, the logits in float32
    want.update({"embedding": 1, "_rms_norm_kernel": 1, "gemm": 1, "to": 1})
    assert kinds == want


@pytest.mark.parametrize("variant", ["mixtral-4x2", "qwen3moe-8x3-norm-dense0"])
def test_moe_through_the_grouped_experts_kernel_matches_transformers(
        model_dirs, hf_reference, kernel_calls, monkeypatch, variant):
    """Mixtral's and Qwen3-MoE's experts grouped on the device, each decode batch routed in
    one launch (engine/kernels/gpu/fused_moe.py), prefill and decode steps, the latter
    through the graphs' buffers."""
    model = model_dirs[variant]
    grouped = count_calls(monkeypatch, triton_ops(), "moe_experts")
    routed = count_calls(monkeypatch, triton_ops(), "route_softmax_topk")
    llm = LLM(model, device="cpu", dtype="float32", num_kv_blocks=64, block_size=8)
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, max_batch=4, max_model_len=128)
    prompts = random_prompts(3, 6, 14, seed=24)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        assert out.token_ids == hf_reference(model, prompt, 4)
    assert grouped, "no step grouped its experts on the device"
    assert routed, "no step routed its tokens in one launch"
    assert_pool_clean(llm.engine.block_pool)


@pytest.mark.parametrize("variant", ["deepseek-v2-qlora-grouped",
                                     "deepseek-v3-plain-topk-rotate-half"])
def test_mla_decodes_read_the_latent_cache_in_place_through_the_graph_buffers(
        model_dirs, hf_reference, kernel_calls, monkeypatch, variant):
    """DeepSeek's absorbed decode on the GPU path: every head a row of the one latent KV
    head, the cache's entries the keys and their latent the values, read in place by the
    paged kernel (no gather, no mask), so its decode steps go through the graphs' buffers;
    latents narrower than a power of two, RoPE parts narrower than tl.dot's 16. Prefill
    chunks after a prefix hit or an earlier chunk attend through the lower-right causal bias
    (no mask tensor)."""
    model = model_dirs[variant]
    llm = LLM(model, device="cpu", dtype="float32", num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=16)
    runner = llm.engine.runner
    assert cuda_graphs.layers_blocker(runner.model) is None
    runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, max_batch=4, max_model_len=128)
    replays = count_calls(monkeypatch, DecodeGraphs, "replay")
    gathered = count_calls(monkeypatch, MLAttention, "_gathered_latent_attention")
    lower_right = count_calls(monkeypatch, mla, "_causal_lower_right")
    prefix = random_prompts(1, 13, 13, seed=26)[0]
    prompts = random_prompts(2, 6, 20, seed=25) + [prefix + [5, 6], prefix + [7, 8, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        assert out.token_ids == hf_reference(model, prompt, 5)
    assert replays and kernel_calls["paged_attention"] and not gathered and lower_right
    assert_pool_clean(llm.engine.block_pool)


def test_mla_that_expands_its_latent_for_decodes_stays_eager(model_dirs):
    llm = LLM(model_dirs["deepseek-v2-qlora-grouped"], device="cpu", dtype="float32",
              num_kv_blocks=8)
    model = llm.engine.runner.model
    for layer in model.layers:
        layer.self_attn.absorb_decode = False  # gathers and expands per context token
    assert "expand the latent" in cuda_graphs.layers_blocker(model)


def test_a_failed_capture_leaves_decode_steps_eager(model_dirs, monkeypatch, caplog):
    llm = LLM(model_dirs["llama-gqa"], device="cpu", dtype="float32", num_kv_blocks=8)
    runner = llm.engine.runner

    def fail(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr("pdcluster.engine.runner.model_runner.graph_blocker",
                        lambda model, kv_cache: None)
    monkeypatch.setattr(DecodeGraphs, "capture", fail)
    assert runner.capture_graphs(4, 64) is False and runner.graphs is None
    assert "decode steps run eagerly" in caplog.text


def test_batch_buckets():
    assert cuda_graphs.batch_buckets(1) == [1]
    assert cuda_graphs.batch_buckets(3) == [1, 2, 3]
    assert cuda_graphs.batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert cuda_graphs.batch_buckets(256)[-6:] == [112, 128, 160, 192, 224, 256]
    assert cuda_graphs.batch_buckets(100)[-3:] == [80, 96, 100]
    with pytest.raises(ValueError, match="max_batch"):
        cuda_graphs.batch_buckets(0)


def test_graph_blockers_name_why(model_dirs):
    llm = LLM(model_dirs["llama-gqa"], device="cpu", dtype="float32", num_kv_blocks=8)
    runner = llm.engine.runner
    assert "CUDA" in cuda_graphs.graph_blocker(runner.model, runner.kv_cache)
    assert runner.capture_graphs(4, 64) is False and runner.graphs is None
