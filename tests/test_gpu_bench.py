"""The GPU benchmark's floors (pdcluster/benchmarks/gpu_bench.py), checked on CPU: the weight
bytes a batch-1 decode step must read, for a dense shape and an MoE one, and its refusal of
shapes it does not know."""

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


def test_unknown_shapes_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="llama-70b"):
        gpu_bench.gpu_fields(["llama-1b"], ["llama-70b"], True, tmp_path)
