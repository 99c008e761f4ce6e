"""The Triton kernels (engine/kernels/gpu) against their torch definitions
(engine/kernels/gpu/reference.py), on fresh random inputs: block sizes, GQA ratios, head dims
64/128/192, contexts around block boundaries and long ones, several chunks per launch, chunks
starting mid-block. On a GPU they run compiled; on CPU through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from pdcluster.engine.kernels.gpu import reference as ref
from tests.triton_kernels import kernel_device, triton_ops

DEVICE = kernel_device()
ON_GPU = DEVICE.type == "cuda"


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: summation order only; bfloat16: rounding of the operands."""
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    err = (got.double() - want.double()).norm() / max(want.double().norm(), 1e-12)
    assert err < tol, f"relative error {err:.2e}"
    assert not got.isnan().any()


def _cache(num_blocks: int, block_size: int, kv_heads: int, dim: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 2, block_size, kv_heads, dim)  # one layer's two planes
    region = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    return region[:, 0], region[:, 1]  # strided views, as PagedKVCache.layer_kv gives


DECODE_CASES = [
    # block_size, kv_heads, group, dim, lens
    (16, 2, 4, 64, [1, 15, 16, 17]),
    (8, 1, 8, 128, [7, 8, 9, 64]),
    (16, 4, 1, 192, [33, 3]),
    (4, 2, 2, 64, [300, 1]),  # long against tiny blocks: every split busy
]
if ON_GPU:
    DECODE_CASES += [(16, 8, 4, 128, [1, 500, 2049, 4096]), (32, 8, 8, 128, [31, 32, 33])]


@pytest.mark.parametrize("block_size, kv_heads, group, dim, lens", DECODE_CASES)
def test_paged_decode_attention_matches_the_reference(block_size, kv_heads, group, dim, lens):
    ops = triton_ops()
    blocks_per_seq = -(-max(lens) // block_size)
    num_blocks = blocks_per_seq * len(lens) + 3
    k_cache, v_cache = _cache(num_blocks, block_size, kv_heads, dim, torch.float32, seed=dim)
    gen = torch.Generator().manual_seed(len(lens))
    table = torch.stack([torch.randperm(num_blocks, generator=gen)[:blocks_per_seq]
                         for _ in lens]).to(DEVICE)
    rows = torch.randn(len(lens), kv_heads, group, dim, generator=gen).to(DEVICE)
    lens_t = torch.tensor(lens, device=DEVICE)
    want_out, want_lse = ref.paged_attention(rows.double(), k_cache.double(), v_cache.double(),
                                             table, lens_t, dim ** -0.5)
    for splits in (None, 1, 3):
        out, lse = ops.paged_attention(rows, k_cache, v_cache, table, lens_t, dim ** -0.5,
                                       num_splits=splits)
        _close(out, want_out, torch.float32)
        _close(lse, want_lse, torch.float32)


MLA_CASES = [
    # block_size, heads, latent (the values), rope (the keys' tail), lens
    (16, 16, 512, 64, [1, 16, 17, 40]),  # DeepSeek-V2-Lite's latent and heads
    (4, 5, 32, 8, [3, 4, 5, 70]),  # a tail narrower than tl.dot's 16, an odd head count
]
if ON_GPU:
    MLA_CASES += [(64, 128, 512, 64, [1, 1000, 4096])]  # DeepSeek-V3's 128 heads


@pytest.mark.parametrize("block_size, heads, latent, rope, lens", MLA_CASES)
def test_decode_attention_over_mlas_latent_cache_matches_the_reference(block_size, heads, latent,
                                                                       rope, lens):
    """MLA's absorbed decode: every head a row of the one KV head; the cache's entries are
    the keys (latent, then RoPE part) and their latent the values, read from one view."""
    ops = triton_ops()
    blocks_per_seq = -(-max(lens) // block_size)
    num_blocks = blocks_per_seq * len(lens) + 2
    gen = torch.Generator().manual_seed(latent + rope)
    planes = torch.randn(num_blocks, 1, block_size, 1, latent + rope, generator=gen)
    cache = planes.to(DEVICE)[:, 0]  # [blocks, block_size, 1, latent + rope]
    table = torch.stack([torch.randperm(num_blocks, generator=gen)[:blocks_per_seq]
                         for _ in lens]).to(DEVICE)
    rows = torch.randn(len(lens), 1, heads, latent + rope, generator=gen).to(DEVICE)
    lens_t = torch.tensor(lens, device=DEVICE)
    scale = (latent + rope) ** -0.5
    want_out, want_lse = ref.paged_attention(rows.double(), cache.double(),
                                             cache[..., :latent].double(), table, lens_t, scale)
    for splits in (None, 1):
        out, lse = ops.paged_attention(rows, cache, cache[..., :latent], table, lens_t, scale,
                                       num_splits=splits)
        assert out.shape == (len(lens), 1, heads, latent)
        _close(out, want_out, torch.float32)
        _close(lse, want_lse, torch.float32)


def test_decode_attention_of_an_empty_context_is_zero_with_lse_minus_infinity():
    ops = triton_ops()
    k_cache, v_cache = _cache(4, 8, 2, 64, torch.float32, seed=1)
    rows = torch.randn(2, 2, 3, 64).to(DEVICE)
    table = torch.zeros((2, 2), dtype=torch.int32, device=DEVICE)
    for splits in (None, 1):  # the merge kernel writes the lse, or the split kernel does
        out, lse = ops.paged_attention(rows, k_cache, v_cache, table,
                                       torch.tensor([0, 5], device=DEVICE), 0.125,
                                       num_splits=splits)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert torch.isneginf(lse[0]).all() and torch.isfinite(lse[1]).all()


def test_decode_attention_takes_many_rows_per_kv_head():
    """The cascade's shared pass: every sequence's query rows against blocks they share."""
    ops = triton_ops()
    k_cache, v_cache = _cache(12, 16, 2, 64, torch.float32, seed=2)
    rows = torch.randn(1, 2, 70, 64).to(DEVICE)  # more rows than one tile
    table = torch.arange(10, device=DEVICE)[None]
    lens = torch.tensor([160], device=DEVICE)
    out, lse = ops.paged_attention(rows, k_cache, v_cache, table, lens, 0.125)
    want_out, want_lse = ref.paged_attention(rows.double(), k_cache.double(), v_cache.double(),
                                             table, lens, 0.125)
    _close(out, want_out, torch.float32)
    _close(lse, want_lse, torch.float32)


PREFILL_CASES = [
    # block_size, kv_heads, group, dim, chunks as (first position, length)
    (16, 2, 2, 64, [(0, 37)]),
    (8, 2, 4, 64, [(0, 20), (13, 7), (40, 33)]),  # after a prefix, mid-block, several
    (4, 1, 2, 192, [(5, 1), (0, 18)]),
    (16, 4, 1, 128, [(16, 16), (31, 2)]),
]
if ON_GPU:
    PREFILL_CASES += [(16, 8, 4, 128, [(0, 2048)]), (16, 8, 4, 128, [(1000, 300), (0, 700)])]


@pytest.mark.parametrize("block_size, kv_heads, group, dim, chunks", PREFILL_CASES)
def test_paged_prefill_attention_matches_the_reference(block_size, kv_heads, group, dim,
                                                       chunks):
    ops = triton_ops()
    longest = max(p + n for p, n in chunks)
    blocks_per_chunk = -(-longest // block_size)
    num_blocks = blocks_per_chunk * len(chunks) + 2
    k_cache, v_cache = _cache(num_blocks, block_size, kv_heads, dim, torch.float32, seed=3)
    gen = torch.Generator().manual_seed(dim + len(chunks))
    decodes = 2  # rows before the chunks: the step's decodes, which the kernel must not touch
    starts = [decodes]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], kv_heads * group, dim, generator=gen).to(DEVICE)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:blocks_per_chunk]
                          for _ in chunks]).to(torch.int32).to(DEVICE)
    q_starts = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    first_pos = torch.tensor([p for p, _ in chunks], dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    ops.prefill_attention(q, k_cache, v_cache, out, tables, q_starts, first_pos,
                          max(n for _, n in chunks), dim ** -0.5)
    want = ref.prefill_attention(q.double(), k_cache.double(), v_cache.double(), tables,
                                 q_starts, first_pos, dim ** -0.5)
    _close(out[decodes:], want[decodes:], torch.float32)
    assert out[:decodes].isnan().all()


DTYPES = [torch.float32, torch.bfloat16] if ON_GPU else [torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, size", [(1, 64), (7, 576), (3, 4096)])
def test_rms_norm_and_the_fused_residual_add(dtype, rows, size):
    ops = triton_ops()
    gen = torch.Generator().manual_seed(size)
    x, residual, weight = (torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
                           for shape in ((rows, size), (rows, size), (size,)))
    _close(ops.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6), dtype)
    got_x, got_residual = x.clone(), residual.clone()
    ops.add_rms_norm_(got_x, got_residual, weight, 1e-5)
    assert torch.equal(got_residual, residual + x)  # the sum rounded once, as torch's add
    _close(got_x, ref.rms_norm(residual + x, weight, 1e-5), dtype)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 64), (9, 3, 64), (8, 1, 128)])
def test_rope_and_cache_write_match_the_reference(dtype, heads, kv_heads, dim, qk_norm):
    """With `qk_norm` (Qwen3) each q and k head is RMS-normalised with its own weight before
    it is rotated."""
    ops = triton_ops()
    gen = torch.Generator().manual_seed(heads * dim)
    layers, block_size, num_blocks, tokens = 3, 4, 6, 9
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype).to(DEVICE)
    positions = torch.randint(0, 50, (tokens,), generator=gen).to(DEVICE)
    angles = torch.randn(64, dim // 2, generator=gen)
    cos = torch.cat([angles.cos()] * 2, -1).to(DEVICE)
    sin = torch.cat([angles.sin()] * 2, -1).to(DEVICE)
    region = torch.zeros(num_blocks, kv_heads, layers, 2, block_size, dim, dtype=dtype,
                         device=DEVICE)  # engine/kv/kv_cache.py's layout
    cache_rows = region.view(-1, dim)
    head_stride = layers * 2 * block_size
    per_block = kv_heads * head_stride
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slot_rows = ((slots // block_size) * per_block + slots % block_size).to(DEVICE)
    layer = 1
    original = qkv.clone()
    n_rot = heads + kv_heads
    heads_in = original[:, : n_rot * dim].view(tokens, n_rot, dim)
    norms = None
    if qk_norm:
        norms = tuple((1 + 0.3 * torch.randn(dim, generator=gen)).to(dtype).to(DEVICE)
                      for _ in "qk")
        heads_in = torch.cat((ref.rms_norm(heads_in[:, :heads], norms[0], 1e-6),
                              ref.rms_norm(heads_in[:, heads:], norms[1], 1e-6)), 1)
    ops.rope_and_cache_(qkv, positions, cos, sin, heads, kv_heads, cache_rows, slot_rows,
                        2 * layer * block_size, block_size, head_stride, qk_norm=norms,
                        eps=1e-6)
    want = ref.rope(heads_in, positions, cos, sin)
    rotated = qkv[:, : n_rot * dim].view(tokens, n_rot, dim)
    _close(rotated, want, dtype)
    key_rows = (slot_rows[:, None] + 2 * layer * block_size
                + torch.arange(kv_heads, device=DEVICE)[None, :] * head_stride)  # [T, Hkv]
    assert torch.equal(cache_rows[key_rows], rotated[:, heads:])
    assert torch.equal(cache_rows[key_rows + block_size],
                       original[:, n_rot * dim:].view(tokens, kv_heads, dim))
    written = torch.zeros(cache_rows.shape[0], dtype=torch.bool, device=DEVICE)
    written[key_rows.flatten()] = written[(key_rows + block_size).flatten()] = True
    assert not cache_rows[~written].any(), "the kernel wrote outside the tokens' slots"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, intermediate", [(1, 1536), (5, 100), (2, 8192)])
def test_silu_and_mul(dtype, rows, intermediate):
    ops = triton_ops()
    gen = torch.Generator().manual_seed(intermediate)
    gate_up = torch.randn(rows, 2 * intermediate, generator=gen).to(dtype).to(DEVICE)
    got = ops.silu_and_mul(gate_up, intermediate)
    _close(got, ref.silu_and_mul(gate_up, intermediate), dtype)


MOE_CASES = [
    # tokens, hidden, intermediate, experts, top_k, first_expert, experts of this rank
    (1, 32, 48, 8, 2, 0, 8),  # batch-1 decode: two experts' weights read
    (37, 64, 40, 8, 2, 0, 8),  # widths off the tiles
    (20, 32, 32, 16, 4, 4, 8),  # a tensor-parallel rank's slice: the other pairs are no-ops
    (40, 32, 16, 4, 1, 0, 4),  # an expert with pairs for several tiles
]


def _routing(tokens: int, experts: int, top_k: int, gen, skewed: bool = False):
    scores = torch.randn(tokens, experts, generator=gen)
    if skewed:
        scores[:, 0] += 10.0  # every token picks expert 0
    weights, ids = scores.softmax(-1).topk(top_k, dim=-1)
    return ids, weights


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden, intermediate, experts, top_k, first, local",
                         MOE_CASES)
def test_moe_experts_match_the_reference(dtype, tokens, hidden, intermediate, experts, top_k,
                                         first, local):
    ops = triton_ops()
    gen = torch.Generator().manual_seed(tokens * 7 + experts)
    ids, weights = _routing(tokens, experts, top_k, gen, skewed=top_k == 1)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(local, 2 * intermediate, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(local, hidden, intermediate, generator=gen) / intermediate ** 0.5
    want = ref.moe_experts(x.double(), ids, weights.double(), w13.double(), w2.double(), first)
    args = [t.to(dtype).to(DEVICE) for t in (x, weights, w13, w2)]
    got = ops.moe_experts(args[0], ids.to(DEVICE), args[1], args[2], args[3], first)
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    _close(got.cpu(), want, dtype)
    if first:  # a token with no pair here gets exactly zero
        here = ((ids >= first) & (ids < first + local)).any(-1)
        assert not got.cpu()[~here].any()


@pytest.mark.parametrize("tokens, top_k, experts, first, local, block_m, skewed", [
    (23, 3, 12, 4, 6, 8, False),     # a tensor-parallel rank's slice of the experts
    (1, 2, 8, 0, 8, 16, False),      # batch-1 decode
    (150, 4, 64, 0, 64, 16, False),  # more pairs than one pass of the kernel takes
    (90, 2, 128, 0, 128, 64, True),  # most pairs on one expert, many experts
])
def test_moe_layout_equals_the_torch_definition(tokens, top_k, experts, first, local,
                                                block_m, skewed):
    ops_module = _fused_moe()
    gen = torch.Generator().manual_seed(tokens)
    ids, _ = _routing(tokens, experts, top_k, gen, skewed)
    got = ops_module.moe_layout(ids.to(DEVICE), first, local, block_m)
    want = ref.moe_layout(ids, first, local, block_m)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden, experts, top_k, renormalize, scale", [
    (1, 64, 8, 2, True, 1.0),      # Mixtral's batch-1 decode
    (37, 96, 128, 8, True, 1.0),   # Qwen3-MoE's 128 experts, hidden off the tiles
    (5, 32, 6, 1, False, 2.5),     # top-1 without renormalisation, scaled
    (70, 200, 60, 3, False, 1.0),  # experts and top-k off a power of two
])
def test_the_router_kernel_picks_the_reference_experts(dtype, tokens, hidden, experts, top_k,
                                                        renormalize, scale):
    ops = triton_ops()
    gen = torch.Generator().manual_seed(tokens + experts)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(experts, hidden, generator=gen) / hidden ** 0.5).to(dtype).to(DEVICE)
    ids, weights = ops.route_softmax_topk(x, weight, top_k, renormalize, scale)
    want_ids, want_weights = ref.route_softmax_topk(x.cpu(), weight.cpu(), top_k,
                                                    renormalize, scale)
    assert ids.dtype == torch.int64 and weights.dtype == dtype
    assert torch.equal(ids.cpu(), want_ids)
    _close(weights.cpu(), want_weights, dtype)


def _fused_moe():
    triton_ops()  # the kernel modules imported (interpreted off a GPU)
    from pdcluster.engine.kernels.gpu import fused_moe

    return fused_moe


def test_moe_layout_gives_each_expert_whole_tiles_and_each_pair_one_row():
    moe_layout = _fused_moe().moe_layout
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 12, (23, 3), generator=gen)
    row_pair, tile_expert = moe_layout(ids.to(DEVICE), 4, 6, 8)
    row_pair, tile_expert = row_pair.cpu(), tile_expert.cpu()
    flat = ids.reshape(-1)
    mine = ((flat >= 4) & (flat < 10)).nonzero().flatten()
    assert sorted(row_pair[row_pair >= 0].tolist()) == mine.tolist()
    assert tile_expert.shape[0] == -(-flat.numel() // 8) + 6
    for tile, expert in enumerate(tile_expert.tolist()):
        pairs = row_pair[tile * 8:(tile + 1) * 8]
        pairs = pairs[pairs >= 0]
        if expert == 6:
            assert not len(pairs), "a tile past the used ones holds pairs"
        else:
            assert len(pairs) and (flat[pairs] - 4 == expert).all()
