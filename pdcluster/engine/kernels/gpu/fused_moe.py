"""A mixture-of-experts layer's routed experts in Triton, without a host sync: a CUDA graph can
hold it.

The torch path (engine/models/moe.py `Experts`) groups a step's (token, expert) pairs by
expert, and loops over the experts on the host. So it must read the per-expert counts back
first: a sync, which no CUDA graph can hold. Here the grouping stays on the device:

1. `moe_layout` (one program) groups the pairs by expert and places each expert's pairs in
   a segment of whole BLOCK_M-row tiles (`row_pair`: the pair a row computes, -1 for
   padding), and names each tile's expert (`tile_expert`; `num_local` past the last used
   tile). Every size is bounded by the shapes alone: `tiles = cdiv(pairs, BLOCK_M) +
   experts`.
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

The router before them is one launch too (`route_softmax_topk`, for softmax scoring
without groups or a score bias: Mixtral, Qwen3-MoE): logits, softmax, top-k and the
weights' renormalisation and scale, per token.

API: `moe_experts(x, ids, weights, w13, w2, first_expert)`, `moe_layout(...)`,
`route_softmax_topk(x, weight, top_k, renormalize, scale)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdcluster.engine.kernels.gpu.decode_attention import precision


@triton.jit
def _route_kernel(X, W, IDS, WEIGHTS, stride_x, stride_w, hidden, num_experts, scale,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    """One token: its router logits in float32, their softmax, the top-k, then (optionally)
    renormalised over the k and scaled."""
    tok = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    e_ok = experts < num_experts
    acc = tl.zeros([BLOCK_E, BLOCK_H], tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_ok = hs < hidden
        x = tl.load(X + tok * stride_x + hs, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(W + experts[:, None].to(tl.int64) * stride_w + hs[None, :],
                    mask=e_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    logits = tl.where(e_ok, tl.sum(acc, 1), float("-inf"))
    p = tl.exp(logits - tl.max(logits, 0))
    p = p / tl.sum(p, 0)
    left = tl.where(e_ok, p, -1.0)  # probabilities are >= 0: -1 is never picked
    picks = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int64)
    vals = tl.zeros([BLOCK_K], tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(left, 0)
        at = tl.min(tl.where(left == best, experts, BLOCK_E), 0)  # the lowest id of a tie
        ids = tl.where(picks == j, at.to(tl.int64), ids)
        vals = tl.where(picks == j, best, vals)
        left = tl.where(experts == at, -1.0, left)
    if RENORMALIZE:
        vals = vals / tl.sum(vals, 0)
    tl.store(IDS + tok * TOP_K + picks, ids, mask=picks < TOP_K)
    tl.store(WEIGHTS + tok * TOP_K + picks, (vals * scale).to(WEIGHTS.dtype.element_ty),
             mask=picks < TOP_K)


def route_softmax_topk(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A softmax router in one launch: `x [T, H]`, `weight [E, H]` -> `(ids [T, k] int64,
    weights [T, k] in x's dtype)`: the top-k of `softmax(x @ weight.T)` (logits in float32),
    renormalised over the k if asked, times `scale`; as engine/models/moe.py `Router` does
    in torch ops for softmax scoring without groups or a score bias."""
    tokens, hidden = x.shape
    num_experts = weight.shape[0]
    assert x.stride(-1) == 1 and weight.stride(-1) == 1, "rows are contiguous"
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=x.device)
    weights = torch.empty((tokens, top_k), dtype=x.dtype, device=x.device)
    block_e = triton.next_power_of_2(num_experts)
    _route_kernel[(tokens,)](x, weight, ids, weights, x.stride(0), weight.stride(0), hidden,
                             num_experts, scale, TOP_K=top_k, RENORMALIZE=renormalize,
                             BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=block_e,
                             BLOCK_H=max(16, min(128, 8192 // block_e)), num_warps=4)
    return ids, weights


@triton.jit
def _layout_kernel(IDS, ROW_PAIR, TILE_EXPERT, pairs, first_expert, num_local, rows, tiles,
                   BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program: `moe_layout`'s result in three passes over the pairs, BLOCK_P at a time.
    An expert's pairs keep their order (as a stable sort keeps it)."""
    experts = tl.arange(0, BLOCK_E)
    local = experts < num_local
    offs = tl.arange(0, BLOCK_P)
    for r0 in range(0, rows, BLOCK_P):  # every row padding until a pair takes it
        tl.store(ROW_PAIR + r0 + offs, tl.full([BLOCK_P], -1, tl.int32), mask=r0 + offs < rows)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, pairs, BLOCK_P):
        e = tl.load(IDS + p0 + offs, mask=p0 + offs < pairs, other=-1) - first_expert
        hot = (e[:, None] == experts[None, :]) & local[None, :]
        counts += tl.sum(hot.to(tl.int32), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    placed = ends - padded  # each expert's next free row
    tl.debug_barrier()  # the padding is stored before any pair's row
    for p0 in range(0, pairs, BLOCK_P):
        ok = p0 + offs < pairs
        e = tl.load(IDS + p0 + offs, mask=ok, other=-1) - first_expert
        hot = ((e[:, None] == experts[None, :]) & local[None, :]).to(tl.int32)
        before = tl.cumsum(hot, 0) - hot  # earlier pairs of the chunk on the same expert
        row = tl.sum(hot * (placed[None, :] + before), 1)
        mine = tl.sum(hot, 1) > 0
        tl.store(ROW_PAIR + row, (p0 + offs).to(tl.int32), mask=ok & mine)
        placed += tl.sum(hot, 0)
    for t0 in range(0, tiles, BLOCK_P):
        t = t0 + offs
        done = (ends[None, :] <= (t * BLOCK_M)[:, None]) & local[None, :]
        tl.store(TILE_EXPERT + t, tl.sum(done.to(tl.int32), 1), mask=t < tiles)


def moe_layout(ids: torch.Tensor, first_expert: int, num_local: int, block_m: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(row_pair [tiles * block_m] int32, tile_expert [tiles] int32)` for the (token,
    expert) pairs `ids [T, k]` (global expert ids) on the experts `first_expert ..
    first_expert + num_local - 1`: expert e's pairs fill whole tiles from the end of expert
    e - 1's, in their order; `row_pair` names each row's pair (-1: padding), `tile_expert`
    each tile's expert (`num_local` past the last used tile). One launch, no sync
    (`reference.moe_layout` is the same in torch ops)."""
    pairs = ids.numel()
    tiles = -(-pairs // block_m) + num_local
    row_pair = torch.empty(tiles * block_m, dtype=torch.int32, device=ids.device)
    tile_expert = torch.empty(tiles, dtype=torch.int32, device=ids.device)
    block_e = triton.next_power_of_2(num_local + 1)
    _layout_kernel[(1,)](ids.reshape(-1), row_pair, tile_expert, pairs, first_expert,
                         num_local, tiles * block_m, tiles, BLOCK_M=block_m,
                         BLOCK_P=max(16, min(64, 8192 // block_e)), BLOCK_E=block_e,
                         num_warps=4)
    return row_pair, tile_expert


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
    if dtype == torch.float32:  # IEEE products in registers: 8 warps share them, no spill
        return block_m, 64, 32, 8
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
