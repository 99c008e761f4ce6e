"""Config sections of the model families beyond the dense decoder, parsed from a Hugging Face
`config.json`: mixture-of-experts routing (`MoEConfig`: Mixtral, Qwen3-MoE, DeepSeek-V2/V3)
and Multi-head Latent Attention (`MLAConfig`: DeepSeek-V2/V3). `parse_moe` / `parse_mla`
return None for architectures without the feature. Torch-free, like `engine.models.model_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2_sum")


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """How a sparse layer routes a token: score every expert (`softmax` or `sigmoid`), keep the
    best `topk_groups` of `num_groups` expert groups (grouped top-k; one group = plain top-k),
    pick `top_k` experts, optionally renormalise their weights, scale them."""

    num_experts: int
    top_k: int
    intermediate_size: int
    moe_layers: tuple[int, ...]  # the others are dense (config `intermediate_size`)
    scoring: str = "softmax"
    norm_topk_prob: bool = True
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"  # a group's score: its best expert, or the sum of its best two
    score_bias: bool = False  # DeepSeek-V3's e_score_correction_bias (selection only)
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0  # one always-on shared MLP of this size; 0 = none

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {self.num_experts}], "
                             f"got {self.top_k}")
        if self.scoring not in SCORINGS or self.group_score not in GROUP_SCORES:
            raise ValueError(f"unknown MoE scoring {self.scoring!r}/{self.group_score!r}")
        if self.num_experts % self.num_groups or not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(f"{self.num_experts} experts cannot form {self.num_groups} groups "
                             f"with {self.topk_groups} kept")


@dataclass(frozen=True, slots=True)
class MLAConfig:
    q_lora_rank: int | None  # None: q is one full-rank projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # RoPE pairs adjacent dims (x0, x1), (x2, x3), ...
    attention_bias: bool = False


def parse_moe(arch: str, hf: dict[str, Any]) -> MoEConfig | None:
    layers = range(hf["num_hidden_layers"])
    if arch == "MixtralForCausalLM":
        return MoEConfig(hf["num_local_experts"], hf["num_experts_per_tok"],
                         hf["intermediate_size"], tuple(layers))
    if arch == "Qwen3MoeForCausalLM":
        step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
        # Qwen's checkpoints say num_experts; transformers 5 saves num_local_experts.
        num_experts = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]
        sparse = tuple(i for i in layers if num_experts > 0 and i not in dense
                       and (i + 1) % step == 0)
        return MoEConfig(num_experts, hf["num_experts_per_tok"], hf["moe_intermediate_size"],
                         sparse, norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    if arch in _DEEPSEEK:
        return _deepseek_moe(arch, hf, layers)
    return None


def _deepseek_moe(arch: str, hf: dict[str, Any], layers: range) -> MoEConfig:
    first_dense = hf.get("first_k_dense_replace") or 0
    num_experts = hf["n_routed_experts"]
    inter = hf["moe_intermediate_size"]
    common = dict(num_experts=num_experts, top_k=hf["num_experts_per_tok"],
                  intermediate_size=inter, moe_layers=tuple(i for i in layers if i >= first_dense),
                  routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                  shared_intermediate_size=inter * (hf.get("n_shared_experts") or 0))
    if arch == "DeepseekV3ForCausalLM":
        return MoEConfig(**common, scoring="sigmoid", norm_topk_prob=bool(hf["norm_topk_prob"]),
                         num_groups=hf["n_group"], topk_groups=hf["topk_group"],
                         group_score="top2_sum", score_bias=True)
    method = hf.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"DeepSeek-V2 topk_method {method!r} is not supported")
    grouped = method == "group_limited_greedy"
    # transformers' DeepSeek-V2 never renormalises the top-k weights, whatever norm_topk_prob.
    return MoEConfig(**common, norm_topk_prob=False,
                     num_groups=hf["n_group"] if grouped else 1,
                     topk_groups=hf["topk_group"] if grouped else 1)


def parse_mla(arch: str, hf: dict[str, Any]) -> MLAConfig | None:
    if arch not in _DEEPSEEK:
        return None
    return MLAConfig(
        q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(hf.get("rope_interleave", True)),
        attention_bias=bool(hf.get("attention_bias", False)))
