"""benchmarks/model_counts.py against counts worked out by hand (the arithmetic is in the
comments), for a dense GQA model (SmolLM2-135M's shape), a Mixtral-style MoE and a
DeepSeek-V3-style MLA + MoE model; and the refusal of sliding-window attention."""

from __future__ import annotations

import pytest

from benchmarks.model_counts import model_counts, prefill_flops
from pdcluster.engine.models.model_config import ModelConfig

SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "vocab_size": 49152, "tie_word_embeddings": True, "max_position_embeddings": 8192}

MIXTRAL = {"architectures": ["MixtralForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "vocab_size": 100, "num_local_experts": 8, "num_experts_per_tok": 2,
           "tie_word_embeddings": False, "sliding_window": None}

DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
               "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
               "vocab_size": 100, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
               "qk_rope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 4,
               "num_experts_per_tok": 2, "moe_intermediate_size": 24, "first_k_dense_replace": 1,
               "n_shared_experts": 1, "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
               "routed_scaling_factor": 1.0, "tie_word_embeddings": False}


def test_dense_gqa_smollm2() -> None:
    cfg = ModelConfig.from_hf(SMOLLM2)
    counts = model_counts(cfg)
    # q 576x576 + k 576x192 + v 576x192 + o 576x576 = 884,736 per layer, x 30
    assert counts.attention_params == 26_542_080
    # gate + up + down: 3 x 576 x 1536 = 2,654,208 per layer, x 30
    assert counts.active_ffn_params == counts.total_ffn_params == 79_626_240
    assert counts.active_matmul_params == 106_168_320
    assert counts.lm_head_params == 49152 * 576 == 28_311_552
    assert counts.embedding_params == 0  # tied: the LM head is the embedding
    assert counts.other_params == 61 * 576  # 2 norms per layer + the final one, no biases
    # (106,168,320 + 28,311,552 + 35,136) x 4 bytes
    assert counts.decode_weight_bytes == 538_060_032
    assert counts.total_params == 134_515_008
    flops = prefill_flops(counts, cfg, 2048)
    # 2 x 106,168,320 x 2,048 + 2 x 28,311,552 (the one sampled row's logits)
    assert flops["linears"] == 434_922_061_824
    # 30 layers x 9 heads x (64 + 64) x 2,048 x 2,049
    assert flops["attention"] == 145_025_925_120
    assert flops["total"] == flops["linears"] + flops["attention"]


def test_moe_counts_only_the_routed_experts_a_token_takes() -> None:
    cfg = ModelConfig.from_hf(MIXTRAL)
    counts = model_counts(cfg)
    # 64 x 16 x (2 x 4 + 2 x 2) = 12,288 per layer, x 2
    assert counts.attention_params == 24_576
    # router 64 x 8 = 512; one expert 3 x 64 x 128 = 24,576; active 512 + 2 experts, x 2 layers
    assert counts.active_ffn_params == 2 * (512 + 2 * 24_576) == 99_328
    assert counts.total_ffn_params == 2 * (512 + 8 * 24_576) == 394_240
    assert counts.embedding_params == counts.lm_head_params == 6_400
    assert counts.other_params == 5 * 64
    # (24,576 + 99,328 + 6,400 + 320) x 4
    assert counts.decode_weight_bytes == 522_496
    flops = prefill_flops(counts, cfg, 10)
    assert flops["linears"] == 2 * 123_904 * 10 + 2 * 6_400
    assert flops["attention"] == 2 * 4 * (16 + 16) * 10 * 11


def test_mla_with_shared_experts_and_a_dense_first_layer() -> None:
    cfg = ModelConfig.from_hf(DEEPSEEK_V3)
    counts = model_counts(cfg)
    # per layer: q_a 64x32 + q_b 32x(4 x 12) = 3,584; kv_a 64x(16 + 4) = 1,280;
    # kv_b 16x(4 x (8 + 8)) = 1,024; o (4 x 8)x64 = 2,048 -> 7,936, x 2 layers
    assert counts.attention_params == 15_872
    # layer 0 dense 3 x 64 x 96 = 18,432; layer 1: router 64 x 4 = 256, shared expert
    # 3 x 64 x 24 = 4,608, routed experts 4,608 each (2 of 4 active)
    assert counts.active_ffn_params == 18_432 + 256 + 4_608 + 2 * 4_608 == 32_512
    assert counts.total_ffn_params == 18_432 + 256 + 4_608 + 4 * 4_608 == 41_728
    # norms 5 x 64; q_a and kv_a layernorms (32 + 16) x 2; V3's routing bias: 4
    assert counts.other_params == 320 + 96 + 4
    assert counts.decode_weight_bytes == (15_872 + 32_512 + 6_400 + 420) * 4
    # qk dim 8 + 4, v dim 8: 2 layers x 4 heads x 20 x T (T + 1)
    assert prefill_flops(counts, cfg, 7)["attention"] == 2 * 4 * 20 * 7 * 8


def test_sliding_window_shorter_than_the_prompt_is_refused() -> None:
    cfg = ModelConfig.from_hf({**MIXTRAL, "architectures": ["MistralForCausalLM"],
                               "sliding_window": 16})
    counts = model_counts(cfg)
    assert prefill_flops(counts, cfg, 16)["attention"] > 0
    with pytest.raises(ValueError, match="sliding-window attention"):
        prefill_flops(counts, cfg, 17)
