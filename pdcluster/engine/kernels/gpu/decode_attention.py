"""Paged decode attention in Triton (flash-decoding), reading the paged KV cache in place
through block tables: no gather, no padding, no mask tensor.

Cache views are one layer's `[num_blocks, block_size, num_kv_heads, head_dim]` (any strides
with the last one 1; engine/kv/kv_cache.py). A token `t` of a sequence lives in block
`table[t // block_size]` at row `t % block_size`, so a tile of keys may span blocks of any size.

`paged_attention(rows, k_cache, v_cache, block_table, lens, scale)` has the CPU C++ op's
signature (engine/kernels/csrc/paged_attention.cpp): `rows [S, Hkv, R, D]` are the R query
rows that share KV head h of sequence s (a GQA group; or every sequence's group when S = 1
reads blocks they all share: cascade attention). Each program scores one tile of keys against
all R rows at once, so a key is read once per group. Values may be narrower than keys
(`v_cache [..., Dv]`, Dv < D): MLA's absorbed decode (engine/models/mla.py) attends with all
its heads as the rows of one KV head over the latent cache, whose entries are the keys (the
latent, then the RoPE part: the "tail" past Dv) and whose latent alone is the values.

The context is split into `num_splits` pieces, each a program writing its partial output and
log-sum-exp (base 2); a second kernel merges them. Whichever kernel writes the final
log-sum-exp stores it in natural log, so no third launch rescales it. The split count depends
only on shapes (never on `lens`), so a CUDA graph captured once replays for any context length.

Float32 inputs are multiplied in IEEE float32 (not TF32): with greedy sampling the engine must
give transformers' tokens exactly, and only summation order may differ.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * LOG2E): the kernels use exp2
_LN2 = 0.6931471805599453


@triton.jit
def _decode_split_kernel(
    Q, K, V, TABLE, LENS, OUT, LSE,
    scale_log2, lse_scale,
    stride_qs, stride_qh, stride_qr,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ts,
    stride_os, stride_oh, stride_osplit, stride_or,
    stride_ls, stride_lh, stride_lsplit,
    num_kv_heads, num_rows, head_dim, tail_dim, num_splits,
    BLOCK_SIZE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    # head_dim: the values' dims and the keys' first ones; tail_dim: the keys' dims past
    # them (BLOCK_T = 0: none)
    seq_head = tl.program_id(0)
    split = tl.program_id(1)
    row_tile = tl.program_id(2)
    seq = seq_head // num_kv_heads
    head = seq_head % num_kv_heads
    length = tl.load(LENS + seq).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, length)

    rows = row_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    dim_ok = dims < head_dim
    q_base = Q + seq * stride_qs + head * stride_qh + rows[:, None] * stride_qr
    q = tl.load(q_base + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if BLOCK_T:
        tail = tl.arange(0, BLOCK_T)
        tail_ok = tail < tail_dim
        q_tail = tl.load(q_base + head_dim + tail[None, :],
                         mask=row_ok[:, None] & tail_ok[None, :], other=0.0)

    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for first in range(start, end, BLOCK_N):
        toks = first + tl.arange(0, BLOCK_N)
        tok_ok = toks < end
        block = tl.load(TABLE + seq * stride_ts + toks // BLOCK_SIZE, mask=tok_ok, other=0)
        slot = toks % BLOCK_SIZE
        kv_mask = tok_ok[:, None] & dim_ok[None, :]
        k_base = K + block[:, None].to(tl.int64) * stride_kb + slot[:, None] * stride_kt \
            + head * stride_kh
        k = tl.load(k_base + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if BLOCK_T:
            k_tail = tl.load(k_base + head_dim + tail[None, :],
                             mask=tok_ok[:, None] & tail_ok[None, :], other=0.0)
            s += tl.dot(q_tail, tl.trans(k_tail), input_precision=PRECISION)
        s = s * scale_log2
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(V + block[:, None].to(tl.int64) * stride_vb + slot[:, None] * stride_vt
                    + head * stride_vh + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    empty = l_sum == 0.0
    out = acc / tl.where(empty, 1.0, l_sum)[:, None]
    lse = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, l_sum))) * lse_scale
    base = seq * stride_os + head * stride_oh + split * stride_osplit
    tl.store(OUT + base + rows[:, None] * stride_or + dims[None, :],
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(LSE + seq * stride_ls + head * stride_lh + split * stride_lsplit + rows,
             lse, mask=row_ok)


@triton.jit
def _decode_merge_kernel(
    PART, PART_LSE, OUT, LSE,
    stride_ps, stride_ph, stride_psplit, stride_pr,
    stride_pls, stride_plh, stride_plsplit,
    stride_os, stride_oh, stride_or,
    stride_ls, stride_lh,
    num_kv_heads, num_rows, head_dim, num_splits, lse_scale,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq_head = tl.program_id(0)
    row_tile = tl.program_id(1)
    seq = seq_head // num_kv_heads
    head = seq_head % num_kv_heads
    rows = row_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (dims < head_dim)[None, :]
    lse_base = PART_LSE + seq * stride_pls + head * stride_plh + rows
    top = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for split in range(num_splits):
        top = tl.maximum(top, tl.load(lse_base + split * stride_plsplit, mask=row_ok,
                                      other=float("-inf")))
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    part_base = PART + seq * stride_ps + head * stride_ph
    for split in range(num_splits):
        weight = tl.exp2(tl.load(lse_base + split * stride_plsplit, mask=row_ok,
                                 other=float("-inf")) - safe_top)
        part = tl.load(part_base + split * stride_psplit + rows[:, None] * stride_pr
                       + dims[None, :], mask=mask, other=0.0)
        acc += part * weight[:, None]
        total += weight
    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)[:, None]
    lse = tl.where(empty, float("-inf"), safe_top + tl.log2(tl.where(empty, 1.0, total)))
    lse = lse * lse_scale
    tl.store(OUT + seq * stride_os + head * stride_oh + rows[:, None] * stride_or + dims[None, :],
             out.to(OUT.dtype.element_ty), mask=mask)
    tl.store(LSE + seq * stride_ls + head * stride_lh + rows, lse, mask=row_ok)


def precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: IEEE for float32 (exact parity), the default otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _decode_tiles(num_rows: int, head_dim: int, dtype: torch.dtype
                  ) -> tuple[int, int, int, int, int]:
    """(BLOCK_R, BLOCK_D, BLOCK_N, num_warps, num_stages). Rows padded to tl.dot's 16, at most
    64 and at most 8,192 accumulator entries (MLA's 512-dim latent takes 16 rows a program);
    fewer keys per tile for wide heads, so a program's tiles fit in registers.
    float32's IEEE products run on the FMA units with their operands in registers: 16 rows and
    32 keys (16 of MLA's latent) a tile over 8 warps (larger tiles, or 4 warps, spilled
    registers in Triton 3.6's or 3.9's builds for sm_90; tests/sm90_build.py).
    MLA's latent launches 8 warps and one pipeline stage: built for sm_90 in bfloat16, that
    takes 52 KB of shared memory and 128 registers a thread (two programs a multiprocessor);
    three stages fit too (87 KB) but take 160 registers (one program). Which runs faster is
    not measured on a GPU yet."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:
        return 16, block_d, 16 if block_d > 256 else 32, 8, 1 if block_d > 256 else 3
    block_r = min(max(16, triton.next_power_of_2(num_rows)), 64, max(16, 8192 // block_d))
    block_n = 32 if block_d > 128 or block_r > 16 else 64
    return block_r, block_d, block_n, *((8, 1) if block_d > 256 else (4, 3))


def decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int, max_len: int | None,
                  block_n: int = 32) -> int:
    """How many pieces each sequence's context is split into: enough programs for two waves
    over the GPU's multiprocessors, at most 32, never more than the tiles `max_len` (when
    known) makes. Depends on shapes only, so a captured graph holds for any length."""
    programs = max(1, num_seqs * num_kv_heads)
    splits = min(32, max(1, -(-2 * num_sms // programs)))
    if max_len is not None:
        splits = min(splits, max(1, -(-max_len // block_n)))
    return splits


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # Triton's interpreter on CPU: a few splits, so tests cover the merge
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def paged_attention(rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, lens: torch.Tensor, scale: float,
                    max_len: int | None = None, num_splits: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention: `rows [S, Hkv, R, D]` against each sequence's `lens[s]` cached tokens
    (keys `k_cache [..., D]`, values `v_cache [..., Dv]`, Dv <= D) -> `(out [S, Hkv, R, Dv]
    in rows' dtype, lse [S, Hkv, R] float32, natural log)`; an empty context gives out 0 and
    lse -inf. `max_len` (a host-side bound on `lens`, when known) only trims the split count;
    `num_splits` fixes it."""
    seqs, kv_heads, num_rows, key_dim = rows.shape
    dim = v_cache.shape[-1]
    assert k_cache.shape[-1] == key_dim >= dim, "keys as wide as the rows, values no wider"
    assert rows.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, \
        "the head dimension is contiguous"
    block_r, block_d, block_n, warps, stages = _decode_tiles(num_rows, dim, rows.dtype)
    tail_dim = key_dim - dim
    block_t = max(16, triton.next_power_of_2(tail_dim)) if tail_dim else 0  # tl.dot's least
    splits = num_splits or decode_splits(seqs, kv_heads, num_sms(rows.device), max_len, block_n)
    out = torch.empty((seqs, kv_heads, num_rows, dim), dtype=rows.dtype,
                      device=rows.device)  # contiguous
    lse = torch.empty((seqs, kv_heads, num_rows), dtype=torch.float32, device=rows.device)
    if splits == 1:
        part, part_lse = out.unsqueeze(2), lse.unsqueeze(2)
    else:
        part = torch.empty((seqs, kv_heads, splits, num_rows, dim), dtype=torch.float32,
                           device=rows.device)
        part_lse = torch.empty((seqs, kv_heads, splits, num_rows), dtype=torch.float32,
                               device=rows.device)
    row_tiles = -(-num_rows // block_r)
    _decode_split_kernel[(seqs * kv_heads, splits, row_tiles)](
        rows, k_cache, v_cache, block_table, lens, part, part_lse,
        scale * LOG2E, _LN2 if splits == 1 else 1.0,
        rows.stride(0), rows.stride(1), rows.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        part.stride(0), part.stride(1), part.stride(2), part.stride(3),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        kv_heads, num_rows, dim, tail_dim, splits,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_T=block_t,
        BLOCK_N=block_n, PRECISION=precision(rows.dtype), num_warps=warps, num_stages=stages)
    if splits > 1:
        _decode_merge_kernel[(seqs * kv_heads, row_tiles)](
            part, part_lse, out, lse,
            part.stride(0), part.stride(1), part.stride(2), part.stride(3),
            part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1),
            kv_heads, num_rows, dim, splits, _LN2,
            BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)
    return out, lse
