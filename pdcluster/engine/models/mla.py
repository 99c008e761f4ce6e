"""Multi-head Latent Attention (DeepSeek-V2/V3) over the paged latent KV cache.

Per token and layer the cache holds one entry of `kv_lora_rank + qk_rope_head_dim` values:
the RMS-normed compressed latent `c` and the RoPE'd key `k_pe` shared by every head (one plane
of `engine.kv.kv_cache`, so a block stays one contiguous byte range and moves between nodes as
such). Queries come from a low-rank (`q_lora_rank`) or full projection and split into a
no-position part and a RoPE part (decoupled RoPE; DeepSeek's interleaved pairs are
de-interleaved first, then rotated rotate-half style — the same dot products).

- prefill chunks (the naive form): `kv_b_proj` expands each context entry's latent into
  per-head `k_nope` and `v`; keys are `[k_nope, k_pe]`, as in transformers. A chunk after
  cached or earlier tokens attends causally from the bottom right (its last query sees every
  key): on CUDA as torch's lower-right causal bias, which its fused attention kernels apply
  without a mask tensor; elsewhere through the chunk's `key_pos <= query_pos` mask.
- decodes (the absorbed form, `absorb_decode=True`): `kv_b_proj`'s key half is folded into
  the query (`q_nope @ W_uk` per head) and its value half applied after attention, so a decode
  attends straight over the cached entries as one shared KV head — nothing is expanded per
  context token. The engine's paged decode kernel (the Triton one on CUDA, the C++ one for
  float32 on CPU: engine/kernels) reads the entries in place, every head a row of that one KV
  head, the entries the keys and their latent the values: no gather, no mask, so on CUDA the
  step is a CUDA graph like a Llama's (engine/runner/cuda_graphs.py). Without the kernels the
  context is gathered and masked.
  `absorb_decode=False` expands like prefill (for measurement and tests).
The token order and `AttentionMetadata` are those of `engine.models.attention`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine import kernels
from pdcluster.engine.kernels import gpu
from pdcluster.engine.kv.kv_cache import PagedKVCache
from pdcluster.engine.models.attention_meta import AttentionMetadata, GatherWorkspace, PrefillChunk
from pdcluster.engine.models.linear import Linear
from pdcluster.engine.models.llama import RMSNorm
from pdcluster.engine.models.model_config import ModelConfig
from pdcluster.engine.models.model_families import MLAConfig
from pdcluster.engine.models.parallel import (
    SINGLE,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    head_slice,
)
from pdcluster.engine.models.rope import RotaryEmbedding

_LORA_NORM_EPS = 1e-6  # transformers builds q_a/kv_a_layernorm with the default eps


def mla_config(cfg: ModelConfig) -> MLAConfig:
    """The config's MLA section (`ModelConfig.from_hf` makes one for every MLA family)."""
    assert cfg.mla is not None, f"{cfg.architecture} has no MLA section"
    return cfg.mla


def _decode_tables(meta: AttentionMetadata, block_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode rows' block table and key mask (a step with decodes has both)."""
    assert meta.decode_block_table is not None, "a step with decodes has their block table"
    return meta.decode_block_table, meta.decode_mask(block_size)


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim)^2 when configured."""
    scale = cfg.head_dim**-0.5
    rope = cfg.rope
    factor = rope.factor  # set for every type but "default" (RopeConfig checks)
    if rope.rope_type != "default" and rope.mscale_all_dim and factor is not None and factor > 1:
        mscale = 0.1 * rope.mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class MLAttention(nn.Module):
    """With tensor parallelism each rank holds its heads' query and key/value up-projections
    (column-parallel) and output projection (row-parallel); the latent (the compressed KV and
    the shared RoPE key, what the cache holds) is computed and cached whole on every rank:
    one copy per rank, the same bytes, so a transfer moves one of them."""

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        m, hidden = mla_config(cfg), cfg.hidden_size
        self.layer, self.rope = layer, rope
        self.num_heads = tp.split(cfg.num_heads, "num_attention_heads")
        self.rank, self.nope, self.rope_dim, self.v_dim = (
            m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim)
        self.interleaved = m.rope_interleave
        qk_dim = self.nope + self.rope_dim
        q_rows = [head_slice(cfg.num_heads, qk_dim, tp, "num_attention_heads")]
        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_rows, bias=False)
        else:
            self.q_a_proj = Linear(hidden, m.q_lora_rank, bias=m.attention_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, q_rows, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope_dim,
                                            bias=m.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, _LORA_NORM_EPS)
        kv_rows = [head_slice(cfg.num_heads, self.nope + self.v_dim, tp, "num_attention_heads")]
        self.kv_b_proj = ColumnParallelLinear(self.rank, kv_rows, bias=False)
        self.o_proj = RowParallelLinear(cfg.num_heads * self.v_dim, hidden, m.attention_bias, tp)
        self.scale = softmax_scale(cfg)
        self.absorb_decode = True

    def forward(self, x, positions, kv_cache: PagedKVCache, meta: AttentionMetadata):
        q_nope, q_pe, entry = self._project(x, positions)
        kv_cache.write_latent(self.layer, meta.slot_rows, entry)
        cache = kv_cache.layer_latent(self.layer)
        out = x.new_empty(x.shape[0], self.num_heads, self.v_dim)
        n = meta.num_decodes
        if n:
            decode = self._decode_absorbed if self.absorb_decode else self._decode_expanded
            out[:n] = decode(q_nope[:n], q_pe[:n], cache, meta)
        for chunk in meta.prefills:
            out[chunk.start : chunk.end] = self._prefill(q_nope, q_pe, entry, cache, chunk,
                                                         meta.workspace)
        return self.o_proj(out.flatten(1))

    def _project(self, x, positions):
        """-> q_nope [T, H, nope], q_pe [T, H, rope] (rotated), cache entries [T, rank+rope]."""
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(-1, self.num_heads, self.nope + self.rope_dim).split(
            [self.nope, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        q_pe, k_pe = self.rope(positions, self._deinterleave(q_pe),
                               self._deinterleave(k_pe.unsqueeze(1)))
        return q_nope, q_pe, torch.cat([self.kv_a_layernorm(latent), k_pe.squeeze(1)], dim=-1)

    def _deinterleave(self, t: torch.Tensor) -> torch.Tensor:
        if not self.interleaved:
            return t
        return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)

    def _expand(self, entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries [..., L, rank+rope] -> keys [..., H, L, nope+rope], values [..., H, L, v]."""
        latent, k_pe = entries.split([self.rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(latent).unflatten(-1, (self.num_heads, self.nope + self.v_dim))
        k_nope, values = kv.split([self.nope, self.v_dim], dim=-1)
        k_pe = k_pe.unsqueeze(-2).expand(*k_nope.shape[:-1], self.rope_dim)
        keys = torch.cat([k_nope, k_pe], dim=-1)
        return keys.transpose(-3, -2), values.transpose(-3, -2)

    def _prefill(self, q_nope, q_pe, entry, cache, chunk: PrefillChunk,
                 workspace: GatherWorkspace) -> torch.Tensor:
        s, e = chunk.start, chunk.end
        queries = torch.cat([q_nope[s:e], q_pe[s:e]], dim=-1).transpose(0, 1)
        if chunk.context_len == e - s:  # from position 0: its own keys, causally
            keys, values = self._expand(entry[s:e])
            mask = None
        else:
            entries = workspace.gather(cache, chunk.block_ids, GatherWorkspace.KEYS)
            keys, values = self._expand(entries[0, : chunk.context_len])
            mask = (_causal_lower_right(e - s, chunk.context_len) if gpu.serves(queries)
                    else chunk.mask)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask,
                                             is_causal=mask is None, scale=self.scale)
        return out.transpose(0, 1)

    def _decode_expanded(self, q_nope, q_pe, cache, meta: AttentionMetadata) -> torch.Tensor:
        block_table, mask = _decode_tables(meta, cache.shape[1])
        entries = meta.workspace.gather(cache, block_table, GatherWorkspace.KEYS)
        keys, values = self._expand(entries.squeeze(1))
        queries = torch.cat([q_nope, q_pe], dim=-1).unsqueeze(2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask,
                                             scale=self.scale)
        return out.squeeze(2)

    def _decode_absorbed(self, q_nope, q_pe, cache, meta: AttentionMetadata) -> torch.Tensor:
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w.split([self.nope, self.v_dim], dim=1)
        q_latent = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
        queries = torch.cat([q_latent, q_pe], dim=-1)  # [B, H, rank+rope]
        ops = kernels.layer_ops_for(queries, cache)
        if ops is not None and meta.decode_lens is not None:
            assert meta.decode_block_table is not None, "a step with decodes has their table"
            out, _ = ops.paged_attention(queries.unsqueeze(1), cache, cache[..., : self.rank],
                                         meta.decode_block_table, meta.decode_lens, self.scale)
            out = out.squeeze(1)  # [B, H, rank]
        else:
            out = self._gathered_latent_attention(queries, cache, meta)
        return torch.einsum("bhr,hvr->bhv", out, w_uv)

    def _gathered_latent_attention(self, queries, cache, meta: AttentionMetadata
                                   ) -> torch.Tensor:
        """Plain matmuls, not SDPA: SDPA's CPU path would copy the one shared latent head
        out to every query head, undoing what absorption saves."""
        block_table, mask = _decode_tables(meta, cache.shape[1])
        entries = meta.workspace.gather(cache, block_table, GatherWorkspace.KEYS)
        entries = entries.squeeze(1)  # [B, L, rank+rope]
        scores = torch.matmul(queries, entries.transpose(1, 2)) * self.scale  # [B, H, L]
        scores = scores.masked_fill(~mask[:, 0], float("-inf"))
        return torch.matmul(scores.softmax(-1), entries[..., : self.rank])  # [B, H, rank]


def _causal_lower_right(num_queries: int, num_keys: int) -> torch.Tensor:
    """torch's lower-right causal bias, which SDPA turns into its flash kernel's causal flag.
    Imported here, not at the top: `torch.nn.attention.bias` imports torch's compiler stack
    (two seconds of CPU in every process that imports the engine)."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(num_queries, num_keys)
