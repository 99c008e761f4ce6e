"""A decoder layer's small steps as one Triton kernel each, with the CPU C++ ops' signatures
(engine/kernels/csrc/layer_ops.cpp), so engine/models/llama.py calls either the same way:

- `rms_norm(x, weight, eps)` and `add_rms_norm_(x, residual, weight, eps)` (in place:
  `residual += x`, then `x = norm(residual)`): one read and one write of the rows instead of
  torch's five elementwise passes;
- `rope_and_cache_(qkv, positions, cos, sin, heads, kv_heads, cache_rows, slot_rows,
  row_offset, block_size, head_stride)`: RoPE on q and k in place inside the fused qkv
  projection's output, and each KV head's k and v stored into its cache rows, in one pass;
  here (not in the C++ op) optionally after Qwen3's RMSNorm of each q and k head;
- `silu_and_mul(gate_up, intermediate)`: SwiGLU's `silu(gate) * up` from the fused projection.

Roundings follow the reference modules: the residual sum is rounded to the activation dtype
before the norm reads it; the norm's statistics are float32; the normalised row is rounded
before the weight multiplies it; RoPE's two products are each rounded before they are added
(in float32 every rounding is a no-op, so float32 results differ from torch's by summation
order at most).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, RES, W, OUT, stride_x, stride_r, stride_o, size, eps,
                     ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < size
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if ADD:
        x = (x.to(tl.float32) + tl.load(RES + row * stride_r + cols, mask=ok,
                                        other=0.0).to(tl.float32)).to(X.dtype.element_ty)
        tl.store(RES + row * stride_r + cols, x, mask=ok)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / size + eps)
    normed = (x32 * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (w * normed).to(OUT.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x / rms(x))` over the last dim of 2-D `x`."""
    out = torch.empty_like(x)
    _rms_norm_kernel[(x.shape[0],)](x, x, weight, out, x.stride(0), x.stride(0), out.stride(0),
                                    x.shape[1], eps, ADD=False,
                                    BLOCK=triton.next_power_of_2(x.shape[1]), num_warps=4)
    return out


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> None:
    """In place: `residual += x`, then `x = weight * norm(residual)`."""
    _rms_norm_kernel[(x.shape[0],)](x, residual, weight, x, x.stride(0), residual.stride(0),
                                    x.stride(0), x.shape[1], eps, ADD=True,
                                    BLOCK=triton.next_power_of_2(x.shape[1]), num_warps=4)


@triton.jit
def _head_rms_norm(lo, hi, is_q, Q_W, K_W, cols, col_ok, half, head_dim, eps):
    """Each row (one head) of `lo`/`hi` (its two halves) normalised over the head, times the
    q or the k weight: Qwen3's RMSNorm of every head before RoPE, rounded as RMSNorm is."""
    dtype = lo.dtype
    lo32, hi32 = lo.to(tl.float32), hi.to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(lo32 * lo32, 1) + tl.sum(hi32 * hi32, 1)) / head_dim + eps)
    w_lo = tl.where(is_q[:, None], tl.load(Q_W + cols, mask=col_ok, other=0.0)[None, :],
                    tl.load(K_W + cols, mask=col_ok, other=0.0)[None, :]).to(tl.float32)
    w_hi = tl.where(is_q[:, None], tl.load(Q_W + half + cols, mask=col_ok, other=0.0)[None, :],
                    tl.load(K_W + half + cols, mask=col_ok, other=0.0)[None, :]).to(tl.float32)
    lo = (w_lo * (lo32 * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype)
    hi = (w_hi * (hi32 * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype)
    return lo, hi


@triton.jit
def _rope_and_cache_kernel(QKV, POS, COS, SIN, ROWS, SLOTS, Q_W, K_W, stride_t, stride_pos,
                           stride_row, heads, kv_heads, head_dim, row_offset, value_offset,
                           head_stride, eps,
                           BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                           QK_NORM: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    half = head_dim // 2
    hs = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    col_ok = cols < half
    rotated = hs < heads + kv_heads  # q heads, then k heads
    mask = rotated[:, None] & col_ok[None, :]
    pos = tl.load(POS + tok).to(tl.int64)
    cos_lo = tl.load(COS + pos * stride_pos + cols, mask=col_ok, other=0.0)
    cos_hi = tl.load(COS + pos * stride_pos + half + cols, mask=col_ok, other=0.0)
    sin_lo = tl.load(SIN + pos * stride_pos + cols, mask=col_ok, other=0.0)
    sin_hi = tl.load(SIN + pos * stride_pos + half + cols, mask=col_ok, other=0.0)
    base = QKV + tok * stride_t + hs[:, None] * head_dim + cols[None, :]
    lo = tl.load(base, mask=mask, other=0.0)
    hi = tl.load(base + half, mask=mask, other=0.0)
    if QK_NORM:
        lo, hi = _head_rms_norm(lo, hi, hs < heads, Q_W, K_W, cols, col_ok, half, head_dim, eps)
    dtype = lo.dtype
    # x * cos + rotate_half(x) * sin, each product rounded to x's dtype as torch does
    c_lo, c_hi = cos_lo.to(dtype)[None, :], cos_hi.to(dtype)[None, :]
    s_lo, s_hi = sin_lo.to(dtype)[None, :], sin_hi.to(dtype)[None, :]
    new_lo = ((lo * c_lo).to(tl.float32) + (-hi * s_lo).to(tl.float32)).to(dtype)
    new_hi = ((hi * c_hi).to(tl.float32) + (lo * s_hi).to(tl.float32)).to(dtype)
    tl.store(base, new_lo, mask=mask)
    tl.store(base + half, new_hi, mask=mask)

    slot = tl.load(SLOTS + tok).to(tl.int64)
    # KV head h of this token lives in row slot + row_offset + h * head_stride (keys), and
    # value_offset rows further (values)
    is_key = (hs >= heads) & rotated
    key_rows = slot + row_offset + (hs - heads).to(tl.int64) * head_stride
    key_dst = ROWS + key_rows[:, None] * stride_row + cols[None, :]
    key_mask = is_key[:, None] & col_ok[None, :]
    tl.store(key_dst, new_lo.to(ROWS.dtype.element_ty), mask=key_mask)
    tl.store(key_dst + half, new_hi.to(ROWS.dtype.element_ty), mask=key_mask)
    # values: the heads after the keys, copied as they are
    value_mask = (hs < kv_heads)[:, None] & col_ok[None, :]
    v_src = QKV + tok * stride_t + (heads + kv_heads + hs)[:, None] * head_dim + cols[None, :]
    value_rows = slot + row_offset + value_offset + hs.to(tl.int64) * head_stride
    v_dst = ROWS + value_rows[:, None] * stride_row + cols[None, :]
    tl.store(v_dst, tl.load(v_src, mask=value_mask, other=0.0), mask=value_mask)
    tl.store(v_dst + half, tl.load(v_src + half, mask=value_mask, other=0.0), mask=value_mask)


def rope_and_cache_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, heads: int, kv_heads: int, cache_rows: torch.Tensor,
                    slot_rows: torch.Tensor, row_offset: int, block_size: int,
                    head_stride: int, qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
                    eps: float = 0.0) -> None:
    """`qkv [T, (heads + 2 kv_heads) * D]`: rotate q and k in place (rotate-half RoPE at
    `positions`, tables `[max_pos, D]`), store KV head h's k of token t into `cache_rows
    [slot_rows[t] + row_offset + h * head_stride]` (`cache_rows [R, D]`) and its v
    `block_size` rows further (engine/kv/kv_cache.py's layout). `qk_norm`: the q and k
    RMSNorm weights `[D]` (Qwen3), each head normalised (with `eps`) before it is rotated.
    The CPU C++ op has no `qk_norm`."""
    dim = cos.shape[-1]
    assert qkv.stride(-1) == 1 and cache_rows.is_contiguous(), "rows are contiguous"
    q_weight, k_weight = qk_norm if qk_norm is not None else (qkv, qkv)  # unread without
    _rope_and_cache_kernel[(qkv.shape[0],)](
        qkv, positions, cos, sin, cache_rows, slot_rows, q_weight, k_weight, qkv.stride(0),
        cos.stride(0), cache_rows.stride(0), heads, kv_heads, dim, row_offset, block_size,
        head_stride, eps,
        BLOCK_H=triton.next_power_of_2(heads + kv_heads),
        BLOCK_HALF=max(2, triton.next_power_of_2(dim // 2)), QK_NORM=qk_norm is not None,
        num_warps=4)


@triton.jit
def _silu_and_mul_kernel(X, OUT, stride_x, stride_o, size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < size
    gate = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(X + row * stride_x + size + cols, mask=ok, other=0.0)
    g32 = gate.to(tl.float32)
    act = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
    tl.store(OUT + row * stride_o + cols, (act * up).to(OUT.dtype.element_ty), mask=ok)


def silu_and_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """`silu(gate) * up` for `gate_up [T, 2 * intermediate]` (gate first)."""
    rows = gate_up.shape[0]
    out = torch.empty((rows, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(intermediate))
    _silu_and_mul_kernel[(rows, -(-intermediate // block))](
        gate_up, out, gate_up.stride(0), out.stride(0), intermediate, BLOCK=block, num_warps=4)
    return out
