"""Parameter, byte and FLOP counts of a model, for the efficiency figures of `bench peers`
(prefill FLOP/s against the machine's matmul rate, decode weight bytes against its read
bandwidth). Torch-free: it reads the model's `ModelConfig` only.

Counted per family, each term a weight matrix of the model:
- attention: dense/GQA `q, k, v, o` (`hidden x head_dim x (2 H + 2 Hkv)`), or Multi-head Latent
  Attention (DeepSeek-V2/V3: optional q low-rank pair, `kv_a_proj_with_mqa`, `kv_b_proj`, `o`);
- feed-forward: dense SwiGLU (`3 x hidden x intermediate`), or a sparse layer: the router, the
  shared experts, and `top_k` of the routed experts for what one token multiplies through
  (all of them for what the checkpoint holds);
- the LM head (`vocab x hidden`, tied or not: decode reads it every step), the norms, biases.

Prefill FLOPs of `T` tokens from position 0: `2 x active matmul params x T` for the linears,
plus causal attention `layers x heads x (qk_dim + v_dim) x T (T + 1)` (each query i scores i + 1
keys and mixes i + 1 values, 2 FLOPs per multiply-add), plus the LM head of the one sampled
row. Sliding-window attention shorter than `T` is refused rather than over-counted.

API: `ModelCounts`, `model_counts(cfg)`, `prefill_flops(counts, cfg, tokens)`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pdcluster.engine.models.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class ModelCounts:
    """Parameters by role. `active_*` is what one token multiplies through (MoE: top_k of the
    routed experts); `total_*` what the checkpoint holds."""

    attention_params: int  # every layer's attention projections
    active_ffn_params: int  # every layer's feed-forward, as one token sees it
    total_ffn_params: int
    lm_head_params: int
    embedding_params: int  # looked up one row per token: neither multiplied nor streamed
    other_params: int  # norms and biases: read every step, no matmul FLOPs
    dtype_nbytes: int

    @property
    def active_matmul_params(self) -> int:
        """The decoder layers' linears one token multiplies through (no LM head)."""
        return self.attention_params + self.active_ffn_params

    @property
    def decode_weight_bytes(self) -> int:
        """Weight bytes one batch-1 decode step reads: the active linears, the LM head, norms
        and biases (a sparse layer reads only the experts its token picked)."""
        params = self.active_matmul_params + self.lm_head_params + self.other_params
        return params * self.dtype_nbytes

    @property
    def total_params(self) -> int:
        """What the checkpoint holds (the LM head counted once when tied)."""
        return (self.attention_params + self.total_ffn_params + self.embedding_params
                + self.other_params + self.lm_head_params)

    def to_dict(self) -> dict:
        return {**asdict(self), "active_matmul_params": self.active_matmul_params,
                "decode_weight_bytes": self.decode_weight_bytes}


def model_counts(cfg: ModelConfig, dtype_nbytes: int = 4) -> ModelCounts:
    attention, attention_other = _attention(cfg)
    active_ffn = total_ffn = ffn_other = 0
    for layer in range(cfg.num_layers):
        active, total, other = _ffn(cfg, layer)
        active_ffn, total_ffn, ffn_other = active_ffn + active, total_ffn + total, ffn_other + other
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
    head = cfg.vocab_size * cfg.hidden_size
    return ModelCounts(
        attention_params=attention * cfg.num_layers, active_ffn_params=active_ffn,
        total_ffn_params=total_ffn, lm_head_params=head,
        embedding_params=0 if cfg.tie_word_embeddings else head,
        other_params=norms + attention_other * cfg.num_layers + ffn_other,
        dtype_nbytes=dtype_nbytes)


def _attention(cfg: ModelConfig) -> tuple[int, int]:
    """(matmul params, norm and bias params) of one layer's attention."""
    h, heads = cfg.hidden_size, cfg.num_heads
    mla = cfg.mla
    if mla is None:
        q, kv = heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        other = (q + 2 * kv if cfg.qkv_bias else 0) + (h if cfg.o_bias else 0)
        other += 2 * cfg.head_dim if cfg.qk_norm else 0
        return h * (2 * q + 2 * kv), other
    qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    if mla.q_lora_rank:
        q_params = h * mla.q_lora_rank + mla.q_lora_rank * heads * qk_dim
        other = mla.q_lora_rank  # q_a_layernorm
    else:
        q_params, other = h * heads * qk_dim, 0
    kv_a = h * (mla.kv_lora_rank + mla.qk_rope_head_dim)
    kv_b = mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    out = heads * mla.v_head_dim * h
    other += mla.kv_lora_rank  # kv_a_layernorm
    if mla.attention_bias:  # q_a_proj (when low-rank), kv_a_proj_with_mqa and o_proj
        other += (mla.q_lora_rank or 0) + mla.kv_lora_rank + mla.qk_rope_head_dim + h
    return q_params + kv_a + kv_b + out, other


def _ffn(cfg: ModelConfig, layer: int) -> tuple[int, int, int]:
    """(active matmul params, total matmul params, bias and routing-bias params) of one
    layer's feed-forward."""
    h = cfg.hidden_size
    moe = cfg.moe
    if moe is None or layer not in moe.moe_layers:
        dense = 3 * h * cfg.intermediate_size
        return dense, dense, (2 * cfg.intermediate_size + h if cfg.mlp_bias else 0)
    expert = 3 * h * moe.intermediate_size
    shared = 3 * h * moe.shared_intermediate_size
    router = h * moe.num_experts
    other = moe.num_experts if moe.score_bias else 0
    return (router + shared + moe.top_k * expert, router + shared + moe.num_experts * expert,
            other)


def attention_dims(cfg: ModelConfig) -> tuple[int, int]:
    """(query-key dim, value dim) of one attention head."""
    if cfg.mla is not None:
        return cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim
    return cfg.head_dim, cfg.head_dim


def prefill_flops(counts: ModelCounts, cfg: ModelConfig, tokens: int) -> dict[str, int]:
    """FLOPs of one prompt of `tokens` tokens from position 0 (see the module docstring)."""
    if cfg.sliding_window is not None and cfg.sliding_window < tokens:
        raise ValueError(f"sliding-window attention ({cfg.sliding_window} < {tokens} tokens) "
                         "is not counted: its attention FLOPs are not the causal formula's")
    qk_dim, v_dim = attention_dims(cfg)
    linears = 2 * counts.active_matmul_params * tokens + 2 * counts.lm_head_params
    attention = cfg.num_layers * cfg.num_heads * (qk_dim + v_dim) * tokens * (tokens + 1)
    return {"linears": linears, "attention": attention, "total": linears + attention}
