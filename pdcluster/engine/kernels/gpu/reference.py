"""Plain torch definitions of what each GPU kernel computes: the kernels' tests compare against
these (in float64 where they can), and they state each kernel's contract in a few lines."""

from __future__ import annotations

import torch


def gather_context(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence: `[length, Hkv, D]` from its block table."""
    block_size = cache.shape[1]
    blocks = cache[table[: -(-length // block_size)].long()]
    return blocks.flatten(0, 1)[:length]


def paged_attention(rows, k_cache, v_cache, block_table, lens, scale):
    """`rows [S, Hkv, R, D]` -> `(out [S, Hkv, R, Dv], lse [S, Hkv, R])` (values `[..., Dv]`),
    natural-log lse; an empty context gives out 0 and lse -inf."""
    out = rows.new_zeros(*rows.shape[:3], v_cache.shape[-1])
    lse = torch.full(rows.shape[:3], float("-inf"), dtype=rows.dtype, device=rows.device)
    for s in range(rows.shape[0]):
        length = int(lens[s])
        if length == 0:
            continue
        keys = gather_context(k_cache, block_table[s], length).transpose(0, 1)  # [Hkv, n, D]
        values = gather_context(v_cache, block_table[s], length).transpose(0, 1)
        scores = rows[s] @ keys.transpose(-1, -2) * scale  # [Hkv, R, n]
        lse[s] = torch.logsumexp(scores, -1)
        out[s] = torch.softmax(scores, -1) @ values
    return out, lse


def prefill_attention(q, k_cache, v_cache, block_tables, q_starts, first_pos, scale):
    """`q [T, H, D]` -> `[T, H, D]`: chunk c's queries (rows `q_starts[c]:q_starts[c+1]`, the
    first at position `first_pos[c]`) attend causally to their context in the cache."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for c in range(block_tables.shape[0]):
        start, end = int(q_starts[c]), int(q_starts[c + 1])
        pos0, n = int(first_pos[c]), end - start
        keys = gather_context(k_cache, block_tables[c], pos0 + n)
        values = gather_context(v_cache, block_tables[c], pos0 + n)
        keys = keys.repeat_interleave(group, 1).transpose(0, 1)  # [H, ctx, D]
        values = values.repeat_interleave(group, 1).transpose(0, 1)
        scores = q[start:end].transpose(0, 1) @ keys.transpose(-1, -2) * scale  # [H, n, ctx]
        visible = torch.arange(pos0 + n)[None, :] <= (pos0 + torch.arange(n))[:, None]
        scores = scores.masked_fill(~visible.to(q.device), float("-inf"))
        out[start:end] = (torch.softmax(scores, -1) @ values).transpose(0, 1)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
         ) -> torch.Tensor:
    """Rotate-half RoPE of `x [T, N, D]` at `positions [T]`."""
    half = x.shape[-1] // 2
    c = cos[positions].unsqueeze(1).to(x.dtype)
    s = sin[positions].unsqueeze(1).to(x.dtype)
    return x * c + torch.cat((-x[..., half:], x[..., :half]), -1) * s


def silu_and_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    gate, up = gate_up.split(intermediate, dim=-1)
    return torch.nn.functional.silu(gate) * up


def moe_experts(x, ids, weights, w13, w2, first_expert):
    """`x [T, H]`, routing `ids, weights [T, k]`, experts `w13 [E, 2I, H]`, `w2 [E, H, I]`
    numbered from `first_expert` -> `[T, H]`, pair by pair (pairs on other experts: nothing)."""
    out = torch.zeros_like(x)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - first_expert
            if 0 <= e < w13.shape[0]:
                hidden = silu_and_mul(x[t] @ w13[e].T, w2.shape[2])
                out[t] += weights[t, j] * (hidden @ w2[e].T)
    return out


def moe_layout(ids, first_expert, num_local, block_m):
    """fused_moe.moe_layout in torch ops: the pairs sorted by expert (stably), each expert's
    segment padded to whole tiles, then each tile's expert."""
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


def route_softmax_topk(x, weight, top_k, renormalize, scale):
    """A softmax router: `(ids [T, k], weights [T, k] in x's dtype)`."""
    probs = torch.nn.functional.linear(x.float(), weight.float()).softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, (weights * scale).to(x.dtype)
