"""The model's shape, parsed once from a Hugging Face `config.json`.

`ModelConfig.from_pretrained(path)` reads the checkpoint folder's config and normalises the
fields that differ across architectures and transformers versions (legacy `rope_scaling` +
`rope_theta` versus transformers-5 `rope_parameters`; `head_dim` present or derived; Qwen2's
always-on qkv bias; Qwen3's q/k norms). Mixture-of-experts routing (`MoEConfig`) and DeepSeek's
Multi-head Latent Attention (`MLAConfig`) are parsed by `engine.models.model_families`.
`SUPPORTED_ARCHITECTURES` is the one list of `architectures` names the engine serves.
Torch-free: the scheduler and the CLI may read it without loading weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdcluster.engine.models.model_families import MLAConfig, MoEConfig, parse_mla, parse_moe

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
)
_BIAS_ALWAYS = ("Qwen2ForCausalLM",)
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_WINDOW_OFF_BY_DEFAULT = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """RoPE parameters in transformers-5 form (`rope_parameters`)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {self.rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
            )
        if self.rope_type != "default" and self.factor is None:
            raise ValueError(f"rope type {self.rope_type!r} needs a 'factor'")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> RopeConfig:
        params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
        params.pop("type", None)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
            )
        theta = params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
        if rope_type in ("llama3", "yarn"):
            params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
        if rope_type == "yarn" and params.get("factor") is None:
            # Implicit YaRN factor (DeepSeek-V3 style), as transformers computes it: from the
            # model's context length, never from the engine's possibly capped max_model_len.
            original = params["original_max_position_embeddings"]
            params["factor"] = hf.get("max_position_embeddings", 2048) / original
        known = {f for f in cls.__dataclass_fields__ if f not in ("theta", "rope_type")}
        unknown = set(params) - known - {"partial_rotary_factor"}
        if unknown:
            raise ValueError(f"unknown rope parameters {sorted(unknown)} for type {rope_type!r}")
        if params.pop("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1.0 is not supported")
        return cls(theta=float(theta), rope_type=rope_type, **params)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope: RopeConfig
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None
    torch_dtype: str | None
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def max_model_len(self) -> int:
        """Longest sequence the engine will serve: Mistral's sliding window caps it, because
        the engine attends to the whole context and would diverge beyond the window."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """(planes, heads, dim) of one token's cache entry in one layer: keys and values of
        every KV head, or MLA's single plane (compressed latent + shared RoPE key)."""
        if self.mla is not None:
            return 1, 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return 2, self.num_kv_heads, self.head_dim

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model folder {path}")
        return cls.from_hf(json.loads(config_file.read_text()))

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise ValueError(f"unsupported architectures {archs}; supported: {supported}")
        num_heads = hf["num_attention_heads"]
        is_qwen2 = arch in _BIAS_ALWAYS
        attention_bias = bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window_default = arch not in _WINDOW_OFF_BY_DEFAULT
        window = hf.get("sliding_window") if hf.get("use_sliding_window", window_default) else None
        mla = parse_mla(arch, hf)
        # MLA has no KV heads (DeepSeek configs carry a meaningless num_key_value_heads).
        num_kv_heads = num_heads if mla else hf.get("num_key_value_heads") or num_heads
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        if mla:
            head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            rope=RopeConfig.from_hf(hf),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=window,
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            qk_norm=arch in _QK_NORM,
            moe=parse_moe(arch, hf),
            mla=mla,
            extra=hf,
        )
