"""The GPU benchmark (pdcluster/benchmarks/gpu_bench.py), checked on CPU: its floors (the weight
bytes a batch-1 decode step must read, for a dense shape and an MoE one), its refusal of
shapes it does not know, and one shape's whole run on a tiny shape, so that the GPU's few
minutes are never the first time its steps run."""

from __future__ import annotations

import pytest

from pdcluster.benchmarks import gpu_bench
from pdcluster.engine.models.model_config import ModelConfig


def _config(tmp_path, shape: str) -> ModelConfig:
    return ModelConfig.from_pretrained(str(gpu_bench.write_shape(tmp_path / shape, shape)))


def test_a_dense_step_reads_every_weight_once(tmp_path):
    mc = _config(tmp_path, "llama-8b")
    h, layers = 4096, 32
    per_layer = h * 128 * (2 * 32 + 2 * 8) + 3 * h * 14336 + 2 * h
    assert gpu_bench.weight_bytes_read(mc) == 2 * (layers * per_layer + 128256 * h + h)


def test_an_moe_step_reads_the_router_and_its_top_k_experts_only(tmp_path):
    mc = _config(tmp_path, "qwen3-30b-a3b")
    assert mc.moe is not None and mc.moe.top_k == 8 and len(mc.moe.moe_layers) == 48
    h = 2048
    per_layer = h * 128 * (2 * 32 + 2 * 4) + 128 * h + 3 * h * 8 * 768 + 2 * h
    assert gpu_bench.weight_bytes_read(mc) == 2 * (48 * per_layer + 151936 * h + h)


def test_an_mla_step_reads_its_low_rank_projections_and_its_top_k_experts(tmp_path):
    mc = _config(tmp_path, "deepseek-v2-lite")
    h, heads, rank = 2048, 16, 512
    attention = (h * heads * (128 + 64) + h * (rank + 64) + rank + rank * heads * (128 + 128)
                 + heads * 128 * h)
    dense = attention + 3 * h * 10944 + 2 * h
    sparse = attention + 64 * h + 3 * h * (6 * 1408 + 2 * 1408) + 2 * h
    assert gpu_bench.weight_bytes_read(mc) == 2 * (dense + 26 * sparse + 102400 * h + h)


def test_unknown_shapes_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="llama-70b"):
        gpu_bench.gpu_fields(["llama-1b"], ["llama-70b"], True, tmp_path)


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=32000, tie_word_embeddings=False)
TINY_SIZES = gpu_bench.GpuSizes(decode_steps=6, ttft_len=64, repeats=1, batch=4, prompt_len=32,
                                output_len=4, shared_batch=3, shared_len=32, shared_tail=8,
                                shared_output=4)


TINY_MLA = dict(gpu_bench.SHAPES["deepseek-v2-lite"], hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                n_shared_experts=1, vocab_size=32000)


@pytest.mark.parametrize("tiny", [TINY, TINY_MLA], ids=["llama", "deepseek"])
def test_a_shapes_whole_run_reports_every_figure_on_the_cpu(tmp_path, monkeypatch, tiny):
    monkeypatch.setitem(gpu_bench.SHAPES, "tiny", tiny)
    limits = {"copy_gb_s": 10.0, "matmul_tflops": 0.001}  # a tiny model: figures above 0
    out = gpu_bench.run_shape("tiny", tmp_path, TINY_SIZES, limits, with_hf=True, device="cpu")
    assert out["cuda_graphs"] is False and "decode_replay_ms" not in out  # no graphs on CPU
    floor_ms = gpu_bench.weight_bytes_read(_config(tmp_path, "tiny")) / 10e9 * 1e3
    assert out["decode_floor_ms"] == round(floor_ms, 3)
    for rate in ("decode_ms", "decode_vs_floor", "decode_ms_without_overlap", "ttft_2k_ms",
                 "ttft_2k_mfu", "batch_tok_s", "shared_prefix_tok_s", "hf_batch_tok_s",
                 "hf_shared_prefix_tok_s", "batch_vs_hf", "shared_prefix_vs_hf"):
        assert out[rate] > 0, rate
    assert out["batch_steps_launched_ahead"] == [0, 0]  # look-ahead needs decode graphs
    assert out["decode_kernels"] and out["decode_device_ops_per_step"] > 0
    assert out["decode_device_ops_per_layer"] == round(out["decode_device_ops_per_step"] / 2, 1)
