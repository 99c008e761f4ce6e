"""The decoder used for Llama, Mistral, Qwen2 and Qwen3 checkpoints and their
mixture-of-experts cousins Mixtral and Qwen3-MoE (they differ only in config: GQA ratio,
head_dim, RoPE scaling, Qwen2's qkv bias, Qwen3's per-head q/k RMSNorm, tied embeddings, and
which layers' MLP is a `SparseMoE` from `engine.models.moe`).

Forward takes a flattened batch of tokens (`[T]` ids and positions) plus the step's
`AttentionMetadata`, and returns hidden states `[T, hidden]`; `compute_logits` projects only
the rows the sampler needs. q/k/v and gate/up projections are fused at load time (one matmul
each); RMSNorm follows the reference formula (float32 statistics) so outputs match exactly.

With the engine's kernels (engine.kernels: the C++ ops on CPU for float32, the Triton kernels on
CUDA, one signature each) a layer's small steps are one op each: the residual add and the next
RMSNorm (`add_rms_norm_`, which is why a layer returns its output and the residual stream
separately), RoPE of q and k together with the cache write of k and v (`rope_and_cache_`; on
CUDA Qwen3's q/k norms too, which on CPU take the torch path). A batch-1 decode step of plain
dense layers goes further: the whole stack is one op (`DecodeStack`, `decode_layers_`), the
same kernels in the same order without returning to Python between them.
"""

from __future__ import annotations

import torch
from torch import nn

from pdcluster.engine import kernels
from pdcluster.engine.kernels import gpu
from pdcluster.engine.kv.kv_cache import PagedKVCache
from pdcluster.engine.models.attention import paged_attention
from pdcluster.engine.models.attention_meta import AttentionMetadata
from pdcluster.engine.models.model_config import ModelConfig
from pdcluster.engine.models.moe import MLP, SparseMoE
from pdcluster.engine.models.parallel import (
    SINGLE,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    even_slice,
    head_slice,
)
from pdcluster.engine.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = kernels.layer_ops_for(x, self.weight) if x.dim() == 2 and x.is_contiguous() \
            else None
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
        ops = kernels.layer_ops_for(x, residual, self.weight)
        if ops is not None and x.is_contiguous() and residual.is_contiguous():
            ops.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self(residual), residual


class Attention(nn.Module):
    """With tensor parallelism this rank's query heads and KV heads (engine/models/parallel.py):
    q/k/v column-parallel by heads, the output projection row-parallel."""

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer = layer
        q_rows = head_slice(cfg.num_heads, cfg.head_dim, tp, "num_attention_heads")
        kv_rows = head_slice(cfg.num_kv_heads, cfg.head_dim, tp, "num_key_value_heads")
        self.head_dim = cfg.head_dim
        self.num_heads = q_rows.length // cfg.head_dim
        self.num_kv_heads = kv_rows.length // cfg.head_dim
        self.q_size, self.kv_size = q_rows.length, kv_rows.length
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q_rows, kv_rows, kv_rows],
                                             bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size,
                                        cfg.o_bias, tp)
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
        ops = kernels.layer_ops_for(qkv, kv_cache.tensor)
        norms = {}
        if ops is not None and self.q_norm is not None and self.k_norm is not None:
            # the Triton kernel normalises q and k heads too; the CPU C++ op does not
            ops = ops if gpu.serves(qkv, kv_cache.tensor) else None
            norms = {"qk_norm": (self.q_norm.weight, self.k_norm.weight),
                     "eps": self.q_norm.eps}
        if ops is not None:
            # (q/k norms,) RoPE on q and k in place and k, v into their cache slots: one op.
            ops.rope_and_cache_(qkv, positions, self.rope.cos, self.rope.sin, self.num_heads,
                                self.num_kv_heads, kv_cache.rows, meta.slot_rows,
                                kv_cache.key_row_offset(self.layer), kv_cache.spec.block_size,
                                kv_cache.head_stride, **norms)
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


def make_mlp(cfg: ModelConfig, layer: int, tp: TensorParallel = SINGLE) -> nn.Module:
    """The layer's feed-forward block: sparse where the config routes it, else dense."""
    if cfg.moe is not None and layer in cfg.moe.moe_layers:
        return SparseMoE(cfg.moe, cfg.hidden_size, tp)
    return MLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, tp=tp)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding,
                 attention_cls: type[nn.Module] = Attention,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention_cls(cfg, layer, rope, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = make_mlp(cfg, layer, tp)

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
    constructor takes `(cfg, layer, rope, tp)`) and `rope_dim`. With tensor parallelism
    (`tp`) the embedding and the LM head hold this rank's rows of the vocabulary; the logits
    are gathered, so every rank sees all of them."""

    attention_cls: type[nn.Module] = Attention

    @staticmethod
    def rope_dim(cfg: ModelConfig) -> int:
        return cfg.head_dim

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel = SINGLE
                 ) -> None:
        super().__init__()
        self.config, self.tp = cfg, tp
        self.max_positions = max_positions
        rope = RotaryEmbedding(cfg.rope, self.rope_dim(cfg), max_positions)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rope, self.attention_cls, tp)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ColumnParallelLinear(
            cfg.hidden_size, [even_slice(cfg.vocab_size, tp, "vocab_size")], bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # built at the first batch-1 decode on a cache (None: this model does not fit it)
        self._decode_stack: DecodeStack | None = None
        self._decode_stack_cache: PagedKVCache | None = None

    def init_buffers(self, device: torch.device) -> None:
        """Recompute the RoPE tables (buffers, not weights) on `device` after `to_empty`."""
        rope = RotaryEmbedding(self.config.rope, self.rope_dim(self.config), self.max_positions)
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer), "the decoder holds DecoderLayers only"
            layer.self_attn.rope = rope.to(device)
        self._decode_stack_cache = None  # the stack holds the old tables: built again

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_cache: PagedKVCache, meta: AttentionMetadata):
        x, residual = self.embed_tokens(input_ids), None
        stack = self._one_op_stack(x, kv_cache, meta)
        if stack is not None:  # a batch-1 decode: every layer in one C++ call
            return stack(x, positions, meta)
        for layer in self.layers:
            x, residual = layer(x, residual, positions, kv_cache, meta)
        assert residual is not None, "a model has at least one layer"
        return self.norm.add_forward(x, residual)[0]

    def _one_op_stack(self, x: torch.Tensor, kv_cache: PagedKVCache, meta: AttentionMetadata
                      ) -> DecodeStack | None:
        """The one-op layer stack for this step, where it applies: one token in decode, the
        kernels on for this float32 CPU model, plain dense layers (`DecodeStack.dense_layers`)."""
        if (x.shape[0] != 1 or meta.num_decodes != 1 or meta.prefills or meta.cascade
                or meta.decode_lens is None or meta.decode_block_table is None):
            return None
        if kernels.ops_for(x, kv_cache.tensor) is None:  # built from every source, or not
            return None
        if self._decode_stack_cache is not kv_cache:  # built (or refused) once per cache
            self._decode_stack = DecodeStack.build(self, kv_cache)
            self._decode_stack_cache = kv_cache
        return self._decode_stack

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(self.lm_head(hidden)).float()


class DecodeStack:
    """The arguments of `torch.ops.pdcluster.decode_layers_` that stay fixed from step to step
    (weights, per-layer cache views, RoPE tables), gathered once per model and cache. The op
    runs the same kernels in the same order as the layers' forward, so the tokens do not
    change; it only skips ~10 Python-level calls per layer (engine/kernels/csrc/decode_step.cpp).
    The weights are the parameters themselves (no copy): a reload in place is seen."""

    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, first: Attention,
                 weights: list[torch.Tensor], k_caches: list[torch.Tensor],
                 v_caches: list[torch.Tensor]) -> None:
        self.kv_cache = kv_cache
        self.weights, self.k_caches, self.v_caches = weights, k_caches, v_caches
        self.row_offsets = [kv_cache.key_row_offset(i) for i in range(len(k_caches))]
        self.final_norm, self.eps = model.norm.weight, model.norm.eps
        self.cos, self.sin = first.rope.cos, first.rope.sin
        self.heads, self.kv_heads, self.scale = first.num_heads, first.num_kv_heads, first.scale

    @staticmethod
    def dense_layers(model: CausalLM) -> list[tuple[DecoderLayer, Attention, MLP]] | None:
        """Each layer and its parts where every one is a dense layer of this module's
        `Attention` without biases or q/k norms, in float32 on the CPU, sharing one float32
        RoPE table; else None (the op does not apply)."""
        if model.tp.size > 1:  # the op has no collectives
            return None
        layers: list[tuple[DecoderLayer, Attention, MLP]] = []
        for layer in model.layers:
            if not isinstance(layer, DecoderLayer):
                return None
            attn, mlp = layer.self_attn, layer.mlp
            if (type(attn) is not Attention or type(mlp) is not MLP or attn.q_norm is not None
                    or attn.qkv_proj.bias is not None or attn.o_proj.bias is not None
                    or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None):
                return None
            if any(p.dtype != torch.float32 or p.device.type != "cpu"
                   for p in layer.parameters()):
                return None
            layers.append((layer, attn, mlp))
        rope = layers[0][1].rope if layers else None
        if rope is None or any(attn.rope is not rope for _, attn, _ in layers):
            return None
        if not all(t.dtype == torch.float32 and t.is_contiguous() for t in (rope.cos, rope.sin)):
            return None
        return layers

    @classmethod
    def build(cls, model: CausalLM, kv_cache: PagedKVCache) -> DecodeStack | None:
        layers = cls.dense_layers(model)
        if layers is None:
            return None
        weights: list[torch.Tensor] = []
        k_caches, v_caches = [], []
        for i, (layer, attn, mlp) in enumerate(layers):
            weights += [layer.input_layernorm.weight, attn.qkv_proj.weight, attn.o_proj.weight,
                        layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight,
                        mlp.down_proj.weight]
            keys, values = kv_cache.layer_kv(i)
            k_caches.append(keys)
            v_caches.append(values)
        return cls(model, kv_cache, layers[0][1], weights, k_caches, v_caches)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                 ) -> torch.Tensor:
        assert meta.decode_block_table is not None and meta.decode_lens is not None
        return torch.ops.pdcluster.decode_layers_(
            x, positions, self.weights, self.final_norm, self.eps, self.cos, self.sin,
            self.heads, self.kv_heads, self.kv_cache.rows, self.row_offsets,
            self.kv_cache.spec.block_size, self.kv_cache.head_stride, self.k_caches,
            self.v_caches, meta.slot_rows, meta.decode_block_table, meta.decode_lens, self.scale)
