"""The decoder used for Llama, Mistral, Qwen2 and Qwen3 checkpoints and their
mixture-of-experts cousins Mixtral and Qwen3-MoE (they differ only in config: GQA ratio,
head_dim, RoPE scaling, Qwen2's qkv bias, Qwen3's per-head q/k RMSNorm, tied embeddings, and
which layers' MLP is a `SparseMoE` from `engine.models.moe`).

Forward takes a flattened batch of tokens (`[T]` ids and positions) plus the step's
`AttentionMetadata`, and returns hidden states `[T, hidden]`; `compute_logits` projects only
the rows the sampler needs. q/k/v and gate/up projections are fused at load time (one matmul
each); RMSNorm follows the reference formula (float32 statistics) so outputs match exactly.

With the engine's kernels (engine.kernels; CPU, float32) a layer's small steps are one op
each: the residual add and the next RMSNorm (`add_rms_norm_`, which is why a layer returns
its output and the residual stream separately), RoPE of q and k together with the cache write
of k and v (`rope_and_cache_`; not for Qwen3's q/k norms, which take the torch path).
"""

from __future__ import annotations

import torch
from torch import nn

from pdcluster.engine import kernels
from pdcluster.engine.attention import AttentionMetadata, paged_attention
from pdcluster.engine.kv_cache import PagedKVCache
from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.models.linear import Linear
from pdcluster.engine.models.moe import MLP, FusedLinear, SparseMoE
from pdcluster.engine.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = kernels.ops_for(x, self.weight) if x.dim() == 2 and x.is_contiguous() else None
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor):
        """The residual stream plus `x`, and its norm: `(norm(residual + x), residual + x)`.
        With the engine's kernels one pass, in place (x and residual are the step's own
        intermediates)."""
        ops = kernels.ops_for(x, residual, self.weight)
        if ops is not None and x.is_contiguous() and residual.is_contiguous():
            ops.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self(residual), residual


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = FusedLinear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                                    bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.head_dim**-0.5
        self.rope = rope
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, positions, kv_cache: PagedKVCache, meta: AttentionMetadata):
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(-1, self.num_kv_heads, self.head_dim)
        ops = None if self.q_norm is not None else kernels.ops_for(qkv, kv_cache.tensor)
        if ops is not None:
            # RoPE on q and k in place and k, v into their cache slots: one op.
            ops.rope_and_cache_(qkv, positions, self.rope.cos, self.rope.sin, self.num_heads,
                                self.num_kv_heads, kv_cache.rows, meta.slot_rows,
                                kv_cache.key_row_offset(self.layer), kv_cache.spec.block_size)
            q = qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : qk_size].view(-1, self.num_kv_heads, self.head_dim)
            out = paged_attention(q, k, v, kv_cache, self.layer, meta, self.scale,
                                  cache_written=True)
            return self.o_proj(out.reshape(-1, self.q_size))
        if self.q_norm is None or self.k_norm is None:  # both or neither (cfg.qk_norm)
            # q and k heads side by side: one RoPE pass (the same arithmetic per element).
            qk = self.rope.rotate(positions, qkv[:, :qk_size].view(
                -1, self.num_heads + self.num_kv_heads, self.head_dim))
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = self.q_norm(qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : qk_size].view(-1, self.num_kv_heads,
                                                                 self.head_dim))
            q, k = self.rope(positions, q, k)
        out = paged_attention(q, k, v, kv_cache, self.layer, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


def make_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    """The layer's feed-forward block: sparse where the config routes it, else dense."""
    if cfg.moe is not None and layer in cfg.moe.moe_layers:
        return SparseMoE(cfg.moe, cfg.hidden_size)
    return MLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding,
                 attention_cls: type[nn.Module] = Attention) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention_cls(cfg, layer, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = make_mlp(cfg, layer)

    def forward(self, x, residual, positions, kv_cache, meta):
        """`x` is the previous layer's output (the embeddings for the first, with `residual`
        None); returns this layer's output and the residual stream before it is added, so
        that the next norm adds and normalizes in one step."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, positions, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """Families with another attention subclass this and set `attention_cls` (its
    constructor takes `(cfg, layer, rope)`) and `rope_dim`."""

    attention_cls: type[nn.Module] = Attention

    @staticmethod
    def rope_dim(cfg: ModelConfig) -> int:
        return cfg.head_dim

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.max_positions = max_positions
        rope = RotaryEmbedding(cfg.rope, self.rope_dim(cfg), max_positions)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rope, self.attention_cls)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def init_buffers(self, device: torch.device) -> None:
        """Recompute the RoPE tables (buffers, not weights) on `device` after `to_empty`."""
        rope = RotaryEmbedding(self.config.rope, self.rope_dim(self.config), self.max_positions)
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer), "the decoder holds DecoderLayers only"
            layer.self_attn.rope = rope.to(device)

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_cache: PagedKVCache, meta: AttentionMetadata):
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, kv_cache, meta)
        assert residual is not None, "a model has at least one layer"
        return self.norm.add_forward(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
