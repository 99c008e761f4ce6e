"""A mixture-of-experts layer's routed experts in Triton, without a host sync: a CUDA graph can
hold it.

The torch path (engine/models/moe.py `Experts`) groups a step's (token, expert) pairs by
expert, and loops over the experts on the host. So it must read the per-expert counts back
first: a sync, which no CUDA graph can hold. Here the grouping stays on the device:

1. `moe_layout` sorts the pairs by expert and places each expert's pairs in a segment of
   whole BLOCK_M-row tiles (`row_pair`: the pair a row computes, -1 for padding), and names
   each tile's expert (`tile_expert`; `num_local` past the last used tile). Every size is
   bounded by the shapes alone: `tiles = cdiv(pairs, BLOCK_M) + experts`.
2. `_gate_up_kernel`: a program takes one tile and BLOCK_N columns of the intermediate, and
   computes `silu(x @ gate.T) * (x @ up.T)` of its expert for the tile's rows (their tokens'
   rows of `x`, gathered as it loads them).
3. `_down_kernel`: the same tile through the expert's down projection, scaled by each pair's
   routing weight, stored at the pair's own row of `[pairs, H]`. The caller then sums each
   token's top-k rows. Nothing is accumulated atomically, so a step's result does not depend
   on the order in which programs run.

Tiles past the used ones, and pairs routed to another tensor-parallel rank's experts, cost an
early exit. Each program reads only its own expert's weights: batch-1 decode reads the top-k
experts, not all of them.

API: `moe_experts(x, ids, weights, w13, w2, first_expert)`, `moe_layout(...)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdcluster.engine.kernels.gpu.decode_attention import precision


def moe_layout(ids: torch.Tensor, first_expert: int, num_local: int, block_m: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(row_pair [tiles * block_m] int32, tile_expert [tiles] int32)` for the (token,
    expert) pairs `ids [T, k]` (global expert ids) on the experts `first_expert ..
    first_expert + num_local - 1`. Device ops only, no sync."""
    pairs = ids.numel()
    device = ids.device
    flat = ids.reshape(-1) - first_expert
    flat = flat.masked_fill((flat < 0) | (flat >= num_local), num_local)  # another rank's
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_local] = 0
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(pairs, device=device) - (counts.cumsum(0) - counts)[expert_of]
    tiles = -(-pairs // block_m) + num_local
    dump = tiles * block_m  # where the other ranks' pairs go: one slot past the rows
    row = torch.where(expert_of < num_local, starts[expert_of] + rank, dump)
    row_pair = torch.full((dump + 1,), -1, dtype=torch.int32, device=device)
    row_pair.scatter_(0, row, order.to(torch.int32))
    tile_start = torch.arange(tiles, device=device) * block_m
    tile_expert = torch.searchsorted(ends[:num_local], tile_start, right=True).to(torch.int32)
    return row_pair[:dump], tile_expert


@triton.jit
def _gate_up_kernel(X, W13, H1, ROW_PAIR, TILE_EXPERT,
                    stride_xt, stride_we, stride_wn, stride_ht,
                    hidden, intermediate, top_k, num_local,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(TILE_EXPERT + tile)
    if expert < num_local:
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(ROW_PAIR + rows)
        row_ok = pair >= 0
        token = tl.where(row_ok, pair // top_k, 0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < intermediate
        w = W13 + expert.to(tl.int64) * stride_we
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < hidden
            x = tl.load(X + token[:, None] * stride_xt + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            wg = tl.load(w + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
            wu = tl.load(w + (cols + intermediate)[None, :] * stride_wn + ks[:, None],
                         mask=w_mask, other=0.0)
            gate = tl.dot(x, wg, gate, input_precision=PRECISION)
            up = tl.dot(x, wu, up, input_precision=PRECISION)
        # rounded as the torch path rounds: the GEMMs' outputs in the weights' dtype first
        gate = gate.to(H1.dtype.element_ty).to(tl.float32)
        up = up.to(H1.dtype.element_ty).to(tl.float32)
        act = gate / (1.0 + tl.exp(-gate))
        h = act.to(H1.dtype.element_ty).to(tl.float32) * up
        tl.store(H1 + rows[:, None].to(tl.int64) * stride_ht + cols[None, :],
                 h.to(H1.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(H1, W2, OUT, ROUTE_W, ROW_PAIR, TILE_EXPERT,
                 stride_ht, stride_we, stride_wn, stride_ot,
                 hidden, intermediate, num_local,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(TILE_EXPERT + tile)
    if expert < num_local:
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(ROW_PAIR + rows)
        row_ok = pair >= 0
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        w = W2 + expert.to(tl.int64) * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, intermediate, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < intermediate
            h = tl.load(H1 + rows[:, None].to(tl.int64) * stride_ht + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wd = tl.load(w + cols[None, :] * stride_wn + ks[:, None],
                         mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(h, wd, acc, input_precision=PRECISION)
        route = tl.load(ROUTE_W + tl.where(row_ok, pair, 0), mask=row_ok, other=0.0)
        out = acc.to(OUT.dtype.element_ty).to(tl.float32) * route.to(tl.float32)[:, None]
        safe = tl.where(row_ok, pair, 0).to(tl.int64)
        tl.store(OUT + safe[:, None] * stride_ot + cols[None, :], out.to(OUT.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def _tiles(pairs: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)."""
    if device.type != "cuda":
        return 16, 16, 16, 4  # the interpreter: small tiles run fastest
    block_m = 16 if pairs <= 64 else 64
    if dtype == torch.float32:
        return block_m, 64, 32, 4
    return block_m, 64, 64, 4


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, first_expert: int) -> torch.Tensor:
    """`x [T, H]`, the routing `ids, weights [T, k]` (global expert ids), this rank's experts
    `w13 [E, 2I, H]`, `w2 [E, H, I]` from `first_expert` on -> `[T, H]`: each token's sum over
    its pairs on these experts of `weight * down(silu(gate(x)) * up(x))` (0 for pairs
    elsewhere)."""
    tokens, top_k = ids.shape
    num_local, intermediate, hidden = w13.shape[0], w2.shape[2], x.shape[1]
    pairs = tokens * top_k
    block_m, block_n, block_k, warps = _tiles(pairs, x.dtype, x.device)
    row_pair, tile_expert = moe_layout(ids, first_expert, num_local, block_m)
    tiles = tile_expert.shape[0]
    h1 = torch.empty((tiles * block_m, intermediate), dtype=x.dtype, device=x.device)
    x = x.contiguous()
    _gate_up_kernel[(tiles, triton.cdiv(intermediate, block_n))](
        x, w13, h1, row_pair, tile_expert,
        x.stride(0), w13.stride(0), w13.stride(1), h1.stride(0),
        hidden, intermediate, top_k, num_local,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision(x.dtype),
        num_warps=warps)
    out = torch.zeros((pairs, hidden), dtype=x.dtype, device=x.device)
    route = weights.reshape(-1).contiguous()
    _down_kernel[(tiles, triton.cdiv(hidden, block_n))](
        h1, w2, out, route, row_pair, tile_expert,
        h1.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        hidden, intermediate, num_local,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision(x.dtype),
        num_warps=warps)
    return out.view(tokens, top_k, hidden).sum(1)
