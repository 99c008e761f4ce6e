"""Tiny random checkpoints of the families that `engine.models.tiny_model` does not write by hand
(Qwen3, Mixtral, Qwen3-MoE, DeepSeek-V2/V3), built by transformers itself and saved with
`save_pretrained`, so the checkpoint layout (per-expert weights, MLA names) is the real one.

Weights are redrawn wider than transformers' init (std 0.1, norms around 1, embeddings std 1,
DeepSeek-V3's score-correction bias non-zero) for clear greedy margins, as in tiny_model.
No tokenizer: tests feed token ids. Torch and transformers are imported lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_BASE = dict(vocab_size=32000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
_CLASSES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
         "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
         "mscale": 1.0, "mscale_all_dim": 0.8}

HF_VARIANTS: dict[str, dict[str, Any]] = {
    "qwen3-headdim": {"arch": "qwen3", "head_dim": 32, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1000000.0}},
    "mixtral-4x2": {"arch": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
                    "sliding_window": None},
    "qwen3moe-8x3-norm-dense0": {"arch": "qwen3_moe", "num_experts": 8,
                                 "num_experts_per_tok": 3, "norm_topk_prob": True,
                                 "moe_intermediate_size": 32, "mlp_only_layers": [0]},
    "qwen3moe-6x1-unnorm": {"arch": "qwen3_moe", "num_experts": 6, "num_experts_per_tok": 1,
                            "norm_topk_prob": False, "moe_intermediate_size": 48,
                            "num_key_value_heads": 1},
    "deepseek-v2-qlora-grouped": {
        "arch": "deepseek_v2", "num_key_value_heads": 4, "q_lora_rank": 24,
        "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2, "topk_method": "group_limited_greedy", "n_group": 4,
        "topk_group": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "moe_intermediate_size": 32, "routed_scaling_factor": 1.5},
    "deepseek-v3-yarn-shared2": {
        "arch": "deepseek_v3", "num_key_value_heads": 4, "q_lora_rank": None,
        "kv_lora_rank": 32, "qk_nope_head_dim": 8, "qk_rope_head_dim": 16, "v_head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 3, "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
        "n_shared_experts": 2, "first_k_dense_replace": 0, "moe_intermediate_size": 24,
        "routed_scaling_factor": 2.5, "rope_parameters": _YARN},
    "deepseek-v3-plain-topk-rotate-half": {
        "arch": "deepseek_v3", "num_key_value_heads": 4, "q_lora_rank": 16,
        "kv_lora_rank": 24, "qk_nope_head_dim": 12, "qk_rope_head_dim": 4, "v_head_dim": 20,
        "rope_interleave": False, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "moe_intermediate_size": 16, "routed_scaling_factor": 1.0},
}


def build_hf_model(out_dir: str | Path, arch: str, seed: int, **overrides: Any) -> Path:
    import torch
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in _CLASSES[arch])
    config = config_cls(**{**_BASE, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _widen(model, seed)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


def _widen(model, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if "e_score_correction_bias" in n)
    with torch.no_grad():
        for name, t in sorted(tensors.items()):
            noise = torch.randn(t.shape, generator=gen)
            if name.endswith("norm.weight"):
                t.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name:
                t.copy_(noise)
            else:
                t.copy_(0.1 * noise)
