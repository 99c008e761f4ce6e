"""Paged prefill attention in Triton: every prefill chunk of a step in one varlen launch, each
chunk attending to its cached context plus itself, causally, read in place through its block
table (engine/kernels/gpu/decode_attention.py describes the cache views).

`prefill_attention(q, k_cache, v_cache, out, ...)`: a program takes BLOCK_M queries of one
chunk and one head, and walks keys from position 0 to its last query's position (tiles wholly
below the diagonal without a mask, then the diagonal tiles with `key_pos <= query_pos`). A
chunk's own keys are in the cache already (written before attention), so a chunk after a cached
prefix or an earlier chunk, even one starting mid-block, is the same loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdcluster.engine.kernels.gpu.decode_attention import LOG2E, precision


@triton.jit
def _prefill_tile(q, acc, m, l_sum, K, V, TABLE, chunk, head, first, q_pos, end,
                  stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                  stride_tc, dims, dim_ok, scale_log2,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                  PRECISION: tl.constexpr):
    toks = first + tl.arange(0, BLOCK_N)
    tok_ok = toks < end
    block = tl.load(TABLE + chunk * stride_tc + toks // BLOCK_SIZE, mask=tok_ok, other=0)
    slot = toks % BLOCK_SIZE
    kv_mask = tok_ok[:, None] & dim_ok[None, :]
    k = tl.load(K + block[:, None].to(tl.int64) * stride_kb + slot[:, None] * stride_kt
                + head * stride_kh + dims[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    if CAUSAL:
        s = tl.where(tok_ok[None, :] & (toks[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    l_sum = l_sum * alpha + tl.sum(p, 1)
    v = tl.load(V + block[:, None].to(tl.int64) * stride_vb + slot[:, None] * stride_vt
                + head * stride_vh + dims[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_sum


@triton.jit
def _prefill_kernel(
    Q, K, V, OUT, TABLE, Q_STARTS, FIRST_POS,
    scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_tc,
    group, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    m_tile = tl.program_id(2)
    q_start = tl.load(Q_STARTS + chunk)
    q_len = tl.load(Q_STARTS + chunk + 1) - q_start
    if m_tile * BLOCK_M < q_len:
        first_pos = tl.load(FIRST_POS + chunk)
        kv_head = head // group
        rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        q_pos = first_pos + rows
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < head_dim
        io_mask = row_ok[:, None] & dim_ok[None, :]
        q = tl.load(Q + (q_start + rows)[:, None].to(tl.int64) * stride_qt + head * stride_qh
                    + dims[None, :], mask=io_mask, other=0.0)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # keys every row of the tile sees (below its first query), then the diagonal
        lowest = first_pos + m_tile * BLOCK_M
        end = tl.minimum(lowest + BLOCK_M, first_pos + q_len)
        full_end = (lowest // BLOCK_N) * BLOCK_N
        for first in range(0, full_end, BLOCK_N):
            acc, m, l_sum = _prefill_tile(
                q, acc, m, l_sum, K, V, TABLE, chunk, kv_head, first, q_pos, end,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_tc,
                dims, dim_ok, scale_log2, BLOCK_SIZE, BLOCK_N, False, PRECISION)
        for first in range(full_end, end, BLOCK_N):
            acc, m, l_sum = _prefill_tile(
                q, acc, m, l_sum, K, V, TABLE, chunk, kv_head, first, q_pos, end,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_tc,
                dims, dim_ok, scale_log2, BLOCK_SIZE, BLOCK_N, True, PRECISION)
        out = acc / l_sum[:, None]
        tl.store(OUT + (q_start + rows)[:, None].to(tl.int64) * stride_ot + head * stride_oh
                 + dims[None, :], out.to(OUT.dtype.element_ty), mask=io_mask)


def _prefill_tiles(head_dim: int, dtype: torch.dtype, device: torch.device
                   ) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages) for this head size and dtype.
    float32's IEEE products run on the FMA units with their operands in registers: small
    tiles over 8 warps (64 x 32 over 4 spilled 31 KB a thread at head size 128;
    tests/sm90_build.py)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if device.type != "cuda":
        return 16, 16, block_d, 4, 1  # the interpreter: small tiles run fastest
    if dtype == torch.float32:
        return 32, 16, block_d, 8, 2
    if block_d > 128:
        return 64, 32, block_d, 4, 2
    return 128, 64, block_d, 8, 3


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      out: torch.Tensor, block_tables: torch.Tensor, q_starts: torch.Tensor,
                      first_pos: torch.Tensor, max_chunk_len: int, scale: float) -> None:
    """Every prefill chunk's causal attention over its cached context plus itself, into
    `out`. `q [T, H, D]` (the step's flattened queries; chunk c's are rows
    `q_starts[c]:q_starts[c+1]`, its first at position `first_pos[c]`), `block_tables [C,
    max_blocks]` (int32 or int64), `out [T, H, D]` (rows outside the chunks untouched)."""
    heads, dim = q.shape[1], q.shape[2]
    group = heads // k_cache.shape[2]
    block_m, block_n, block_d, warps, stages = _prefill_tiles(dim, q.dtype, q.device)
    grid = (block_tables.shape[0], heads, -(-max_chunk_len // block_m))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, q_starts, first_pos,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        group, dim,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_N=block_n,
        PRECISION=precision(q.dtype), num_warps=warps, num_stages=stages)
