"""Paged attention over the KV cache: the engine's own kernels where they serve the cache (on
CPU the C++ decode kernel for float32; on CUDA the Triton decode and prefill kernels,
engine/kernels/gpu), torch's scaled_dot_product_attention elsewhere.

On CUDA nothing is gathered: decodes run the Triton paged kernel over each sequence's blocks
(split over the context, flash-decoding), and every prefill chunk of the step runs in one
varlen Triton launch that reads its cached context and its own keys (already written) in
place, causally, with no mask tensor (`PrefillBatch`, built by the runner).

A step's tokens are laid out decode-first: the first `num_decodes` tokens are one query each
from sequences in decode, then each prefill chunk's tokens in turn. Per layer, new keys and
values are written into their cache slots first (`PagedKVCache.write`), then:
- all decode queries run as one call: on CPU with float32 caches, the engine's own kernel
  (`engine.kernels`: `paged_attention`, C++ built at setup) reads each sequence's blocks in
  place — no gather, no padding, the query heads of one KV head sharing each read of a key;
  elsewhere (or when the kernel is not built) one batched SDPA call over the gathered block
  tables, padded to the longest context with a key mask. When every decode sequence starts
  with the same cached blocks (a shared system prompt, W4 of `bench peers`), attention is
  split in two ("cascade"): all queries attend to the shared blocks at once, read once
  instead of once per sequence, each sequence attends to its own remaining blocks, and the
  two partial results are merged through their log-sum-exps (the same softmax, summed in
  another order; the kernel returns log-sum-exps too);
- each prefill chunk attends to its context through its block table. A chunk that starts at
  position 0 uses its own keys with a plain causal mask; a chunk after a cached prefix or an
  earlier chunk gets an explicit mask `key_pos <= query_pos` so chunk boundaries (even
  mid-block) change nothing; on CPU, a chunk of `MIN_SPLIT_CHUNK` tokens or more instead
  attends to the earlier tokens and to its own (causally) in two calls merged the same way,
  which torch's kernel runs up to 1.7x faster than one masked call.
`AttentionMetadata` (engine/models/attention_meta.py) is built once per step by the model runner
and shared by every layer.

Gathers write into a `GatherWorkspace` the runner keeps for its lifetime: the gathered keys of 32
sequences x 1,300 tokens are 32 MB a layer, and a fresh tensor that large is a fresh mmap whose
pages fault in on first write, every time (glibc serves allocations over 32 MB with mmap and
unmaps them when freed). Measured in one decode step of that batch: 11.8 ms a gather into fresh
tensors, 1.7 ms into the reused workspace, and the step 1.13 s -> 0.36 s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdcluster.engine import kernels
from pdcluster.engine.kernels import gpu
from pdcluster.engine.kv.kv_cache import PagedKVCache
from pdcluster.engine.models.attention_meta import (
    AttentionMetadata,
    GatherWorkspace,
    PrefillChunk,
)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: PagedKVCache,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    cache_written: bool = False,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]. Returns [T, H, D]. `cache_written`: k and v are in
    their cache slots already (the kernels' fused RoPE wrote them)."""
    if not cache_written:
        kv_cache.write(layer, meta.slot_rows, k, v)
    k_cache, v_cache = kv_cache.layer_kv(layer)
    if meta.num_decodes and not meta.prefills:  # a decode step: no copy into a second buffer
        return _decode_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode_attention(
            q[: meta.num_decodes], k_cache, v_cache, meta, scale
        )
    batch = meta.prefill_batch
    if batch is not None and gpu.serves(q, k_cache):
        gpu.ops().prefill_attention(q, k_cache, v_cache, out, batch.block_tables,
                                    batch.q_starts, batch.first_pos, batch.max_chunk_len, scale)
        return out
    for chunk in meta.prefills:
        out[chunk.start : chunk.end] = _prefill_attention(q, k, v, k_cache, v_cache, chunk, scale,
                                                          meta.workspace)
    return out


def _decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    ops = kernels.layer_ops_for(q, k_cache)
    if ops is not None and meta.decode_lens is not None:
        return _kernel_decode_attention(ops, q, k_cache, v_cache, meta, scale)
    if meta.cascade is not None:
        return _cascade_decode_attention(q, k_cache, v_cache, meta, scale)
    return _batched_decode_attention(q, k_cache, v_cache, meta, scale)


def _kernel_decode_attention(ops, q, k_cache, v_cache, meta: AttentionMetadata,
                             scale: float) -> torch.Tensor:
    """The paged kernel over each sequence's blocks in place; with a cascade, once over the
    shared blocks for every sequence's rows together (those keys read once for the batch),
    once over each sequence's own blocks, merged by log-sum-exp."""
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[-2]
    # a KV head's query heads as rows (q is a view into the fused q/k projection: the C++ op
    # takes a contiguous copy, the Triton kernel reads it through its strides)
    rows = q.reshape(n, kv_heads, heads // kv_heads, dim)
    if not gpu.serves(q, k_cache):
        rows = rows.contiguous()
    cascade = meta.cascade
    if cascade is None:
        out, _ = ops.paged_attention(rows, k_cache, v_cache, meta.decode_block_table,
                                     meta.decode_lens, scale)
        return out.view(n, heads, dim)
    shared = cascade.shared_block_ids
    batch_rows = rows.permute(1, 0, 2, 3).reshape(1, kv_heads, -1, dim).contiguous()
    shared_lens = torch.full((1,), shared.numel() * k_cache.shape[1], dtype=torch.long,
                             device=q.device)
    out_shared, lse_shared = ops.paged_attention(batch_rows, k_cache, v_cache, shared[None],
                                                 shared_lens, scale)
    out_shared = out_shared.view(kv_heads, n, -1, dim).transpose(0, 1)  # [n, Hkv, G, D]
    lse_shared = lse_shared.view(kv_heads, n, -1).transpose(0, 1)
    out_own, lse_own = ops.paged_attention(rows, k_cache, v_cache, cascade.block_table,
                                           cascade.own_lens, scale)
    return _merge(out_shared, lse_shared, out_own, lse_own).reshape(n, heads, dim)


def _batched_decode_attention(q, k_cache, v_cache, meta: AttentionMetadata,
                              scale: float) -> torch.Tensor:
    """4-D SDPA (torch's CPU flash kernel, GQA and the key mask included). Measured here against
    two explicit matmuls per KV head group with an additive mask: those were 3-6x slower
    (32 x 320 keys: 286 vs 49 ms per call on a loaded machine)."""
    gather, block_table = meta.workspace.gather, meta.decode_block_table
    assert block_table is not None, "a step with decodes has their block table"
    keys = gather(k_cache, block_table, GatherWorkspace.KEYS)
    values = gather(v_cache, block_table, GatherWorkspace.VALUES)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask(k_cache.shape[1]), scale=scale,
        enable_gqa=True)
    return out.squeeze(2)


def _cascade_decode_attention(q, k_cache, v_cache, meta: AttentionMetadata,
                              scale: float) -> torch.Tensor:
    """q [n, H, D]. The query heads of one KV head are rows of one matrix (no GQA expansion):
    against the shared blocks all n sequences' rows form one `[1, Hkv, n * G, D]` query, so
    those keys are read once for the batch; against each sequence's own blocks, `[n, Hkv, G,
    D]`. Measured on W4's decode (32 sequences, 1,024 shared + ~300 own tokens): see
    docs/engine.md."""
    cascade, gather = meta.cascade, meta.workspace.gather
    assert cascade is not None, "the cascade path runs only with the cascade's tables"
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[-2]
    rows = q.view(n, kv_heads, heads // kv_heads, dim)  # [n, Hkv, G, D]
    shared_k = gather(k_cache, cascade.shared_block_ids, GatherWorkspace.SHARED_KEYS)
    shared_v = gather(v_cache, cascade.shared_block_ids, GatherWorkspace.SHARED_VALUES)
    batch_rows = rows.permute(1, 0, 2, 3).reshape(1, kv_heads, -1, dim)  # [1, Hkv, n*G, D]
    out_shared, lse_shared = _attend(batch_rows, shared_k.unsqueeze(0), shared_v.unsqueeze(0),
                                     None, scale)
    out_shared = out_shared.view(kv_heads, n, -1, dim).transpose(0, 1)  # [n, Hkv, G, D]
    lse_shared = lse_shared.view(kv_heads, n, -1).transpose(0, 1)  # [n, Hkv, G]
    own_k = gather(k_cache, cascade.block_table, GatherWorkspace.KEYS)
    own_v = gather(v_cache, cascade.block_table, GatherWorkspace.VALUES)
    out_own, lse_own = _attend(rows, own_k, own_v, cascade.bias, scale)
    out = _merge(out_shared, lse_shared, out_own, lse_own)
    return out.reshape(n, heads, dim).to(q.dtype)


def _attend(q, k, v, bias: torch.Tensor | None, scale: float):
    """Attention `[B, h, R, D]` over `[B, h, S, D]` keys, and each row's log-sum-exp of its
    scores `[B, h, R]` (what merging two partial attentions needs). CPU: torch's flash
    kernel, which returns it; elsewhere the same math in two matmuls."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale)
    return _attend_matmul(q, k, v, bias, scale)


def _attend_matmul(q, k, v, bias: torch.Tensor | None, scale: float):
    """`_attend` off the CPU: scores in float32, then the normalised probabilities."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype)
    return torch.matmul(probs, v), lse


def _prefill_attention(q, k, v, k_cache, v_cache, chunk: PrefillChunk, scale: float,
                       workspace: GatherWorkspace):
    """4-D `[1, heads, T, D]` inputs: torch's CPU flash kernel takes only 4-D ones (3-D falls
    back to the math path, which builds the whole score matrix: ~8x slower at 2,048 tokens)."""
    queries = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
    own_k = k[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
    own_v = v[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
    if chunk.mask is None:
        return _sdpa(queries, own_k, own_v, None, scale)
    if q.device.type == "cpu" and chunk.end - chunk.start >= MIN_SPLIT_CHUNK:
        return _split_prefill_attention(queries, own_k, own_v, k_cache, v_cache, chunk, scale,
                                        workspace)
    keys = workspace.gather(k_cache, chunk.block_ids, GatherWorkspace.KEYS)
    values = workspace.gather(v_cache, chunk.block_ids, GatherWorkspace.VALUES)
    keys, values = keys[:, : chunk.context_len], values[:, : chunk.context_len]
    return _sdpa(queries, keys.unsqueeze(0), values.unsqueeze(0), chunk.mask, scale)


def _sdpa(queries, keys, values, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """One chunk's attention, `[1, H, T, D]` in, `[T, H, D]` out; causal without a mask."""
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask,
                                         is_causal=mask is None, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


# A chunk after cached or earlier tokens at least this long attends in two calls on CPU (see
# `_split_prefill_attention`); below it the masked call is as fast.
MIN_SPLIT_CHUNK = 512


def _split_prefill_attention(queries, own_k, own_v, k_cache, v_cache, chunk: PrefillChunk,
                             scale: float, workspace: GatherWorkspace) -> torch.Tensor:
    """A chunk after `p` earlier tokens as two flash calls merged by log-sum-exp: all queries
    against the earlier tokens (no mask) and against the chunk's own keys (causal), instead of
    one call with an explicit `key_pos <= query_pos` mask, which torch's CPU kernel runs
    without skipping masked blocks. Measured per layer call (SmolLM2 heads, 2 threads):
    64 earlier + 2,048 own 71.6 -> 42.6 ms, 1,024 + 1,024 35.8 -> 27.3 ms, 4,096 + 512
    42.5 -> 36.9 ms, 1,024 + 256 6.2 -> 5.9 ms, 256 + 256 2.6 -> 2.8 ms."""
    earlier = chunk.context_len - queries.shape[2]
    blocks = chunk.block_ids[: -(-earlier // k_cache.shape[1])]
    keys = workspace.gather(k_cache, blocks, GatherWorkspace.KEYS)[:, :earlier]
    values = workspace.gather(v_cache, blocks, GatherWorkspace.VALUES)[:, :earlier]
    out_earlier, lse_earlier = _attend(queries, keys.unsqueeze(0), values.unsqueeze(0), None,
                                       scale)
    out_own, lse_own = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        queries, own_k, own_v, 0.0, True, scale=scale)
    out = _merge(out_earlier, lse_earlier, out_own, lse_own).to(queries.dtype)
    return out[0].transpose(0, 1)


def _merge(out_a, lse_a, out_b, lse_b) -> torch.Tensor:
    """Two attentions of the same queries over disjoint keys -> attention over all the keys:
    each weighted by its share of the total softmax mass (`[..., R, D]` outs, `[..., R]` lses)."""
    total = torch.logaddexp(lse_a, lse_b)
    return (out_a * torch.exp(lse_a - total).unsqueeze(-1)
            + out_b * torch.exp(lse_b - total).unsqueeze(-1))
