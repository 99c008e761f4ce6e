"""The engine's C++ kernels (engine/kernels): built here with the machine's compiler when setup
has not built them, checked against plain softmax attention, their errors, the engine's greedy
tokens through them against transformers' and against the torch paths. Setup's side (the build's
flag fallbacks, a missing or broken library, the GEMM calibration): test_kernels_setup.py."""

from __future__ import annotations

import shutil

import pytest
import torch

from pdcluster.engine import kernels
from pdcluster.engine.kv.kv_cache import KVCacheSpec, PagedKVCache
from pdcluster.engine.models import attention
from tests.helpers import count_calls


@pytest.fixture(scope="module")
def ops():
    if shutil.which("g++") is None:
        pytest.skip("no g++: the engine runs its torch paths (tested everywhere else)")
    kernels.build()
    kernels.ops.cache_clear()
    loaded = kernels.ops()
    assert loaded is not None, "built but not loadable"
    return loaded


def _cache(num_blocks: int, block_size: int, kv_heads: int, dim: int, layers: int = 3):
    """Random keys/values in the engine's real region layout (strided per-layer views)."""
    spec = KVCacheSpec(num_blocks, layers, block_size, kv_heads, dim, 4)
    cache = PagedKVCache(spec, torch.float32, torch.device("cpu"))
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=torch.Generator().manual_seed(0)))
    return cache.layer_kv(1)


def _reference(q, k_cache, v_cache, table, lens, scale):
    """softmax(scale q k^T) v per sequence and KV head, from keys gathered one by one."""
    seqs, heads, rows, dim = q.shape
    bs = k_cache.shape[1]
    out = q.new_zeros(seqs, heads, rows, v_cache.shape[-1])
    lse = torch.full((seqs, heads, rows), float("-inf"))
    for s in range(seqs):
        n = int(lens[s])
        if n == 0:
            continue
        pos = torch.arange(n)
        blocks = table[s][pos // bs]
        keys, values = k_cache[blocks, pos % bs], v_cache[blocks, pos % bs]  # [n, Hkv, D]
        scores = torch.einsum("hrd,nhd->hrn", q[s].double(), keys.double()) * scale
        out[s] = torch.einsum("hrn,nhd->hrd", scores.softmax(-1), values.double()).float()
        lse[s] = torch.logsumexp(scores, -1).float()
    return out, lse


@pytest.mark.parametrize("block_size, kv_heads, rows, dim, lens", [
    (16, 3, 3, 64, [1, 17, 64, 200]),  # SmolLM2's heads; partial and whole blocks
    (4, 2, 1, 32, [0, 5, 12]),  # MHA-like single rows, an empty context
    (16, 1, 40, 64, [300]),  # more rows than one task takes (cascade: every sequence's rows)
    (8, 2, 4, 128, [33, 70]),  # head_dim 128: two register slices of the accumulator
    (8, 2, 3, 20, [9, 31]),  # head_dim not a multiple of 8: the scalar paths
])
def test_paged_attention_equals_softmax_attention(ops, block_size, kv_heads, rows, dim,
                                                  lens) -> None:
    k_cache, v_cache = _cache(64, block_size, kv_heads, dim)
    width = -(-max(max(lens), 1) // block_size)
    gen = torch.Generator().manual_seed(1)
    table = torch.stack([torch.randperm(64, generator=gen)[:width] for _ in lens])
    q = torch.randn(len(lens), kv_heads, rows, dim, generator=gen)
    lens_t = torch.tensor(lens)
    out, lse = ops.paged_attention(q, k_cache, v_cache, table, lens_t, dim**-0.5)
    want_out, want_lse = _reference(q, k_cache, v_cache, table, lens_t, dim**-0.5)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size, heads, latent, rope, lens", [
    (16, 16, 512, 64, [1, 16, 40]),  # DeepSeek-V2-Lite's latent cache and heads
    (4, 5, 24, 4, [3, 9]),  # widths not a multiple of 8: the scalar paths
])
def test_paged_attention_over_mlas_latent_cache(ops, block_size, heads, latent, rope,
                                                lens) -> None:
    """MLA's absorbed decode: all heads the rows of one KV head, the latent cache's entries
    the keys and their first `latent` dims the values (one view each of one plane)."""
    spec = KVCacheSpec(32, 2, block_size, 1, latent + rope, 4, num_planes=1)
    cache = PagedKVCache(spec, torch.float32, torch.device("cpu"))
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=torch.Generator().manual_seed(3)))
    entries = cache.layer_latent(1)
    width = -(-max(lens) // block_size)
    gen = torch.Generator().manual_seed(4)
    table = torch.stack([torch.randperm(32, generator=gen)[:width] for _ in lens])
    q = torch.randn(len(lens), 1, heads, latent + rope, generator=gen)
    lens_t, scale = torch.tensor(lens), (latent + rope) ** -0.5
    out, lse = ops.paged_attention(q, entries, entries[..., :latent], table, lens_t, scale)
    want_out, want_lse = _reference(q, entries, entries[..., :latent], table, lens_t, scale)
    assert out.shape == (len(lens), 1, heads, latent)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_paged_attention_refuses_bad_inputs(ops) -> None:
    k_cache, v_cache = _cache(8, 4, 2, 16)
    q = torch.randn(1, 2, 2, 16)
    table, lens = torch.tensor([[0, 1]]), torch.tensor([8])
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.paged_attention(q.double(), k_cache, v_cache, table, lens, 1.0)
    with pytest.raises(RuntimeError, match="contiguous int64"):
        ops.paged_attention(q, k_cache, v_cache, table.int(), lens, 1.0)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        ops.paged_attention(q, k_cache, v_cache, table, torch.tensor([9]), 1.0)
    with pytest.raises(RuntimeError, match="disagree"):
        ops.paged_attention(torch.randn(1, 3, 2, 16), k_cache, v_cache, table, lens, 1.0)
    with pytest.raises(RuntimeError, match="Dv <= D"):  # values wider than the keys
        ops.paged_attention(q[..., :8].contiguous(), k_cache[..., :8], v_cache, table, lens, 1.0)


@pytest.mark.parametrize("n, k", [(40, 48), (7, 576), (13, 20), (1, 8)])
@pytest.mark.parametrize("bias", [True, False])
def test_gemv_equals_f_linear(ops, n, k, bias) -> None:
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(1, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    torch.testing.assert_close(ops.gemv(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert ops.gemv(x[0], w, b).shape == (n,)  # a 1-D row stays 1-D
    rows = torch.randn(n, k + 5, generator=gen)[:, :k]  # rows contiguous, stride k + 5
    torch.testing.assert_close(ops.gemv(x, rows, b), F.linear(x, rows, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bias", [True, False])
def test_gemv_swiglu_is_swiglu(ops, bias) -> None:
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(3)
    inter, hidden = 300, 64  # more rows than one chunk of the kernel
    x = torch.randn(1, hidden, generator=gen)
    w = torch.randn(2 * inter, hidden, generator=gen) / hidden**0.5
    b = torch.randn(2 * inter, generator=gen) if bias else None
    gate, up = F.linear(x, w, b).split(inter, dim=-1)
    torch.testing.assert_close(ops.gemv_swiglu(x, w, b, inter), F.silu(gate) * up,
                               rtol=1e-5, atol=1e-5)


def test_gemv_refuses_what_it_cannot_take(ops) -> None:
    w = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="one contiguous float32 CPU row"):
        ops.gemv(torch.randn(2, 8), w, None)
    with pytest.raises(RuntimeError, match="K = x's width"):
        ops.gemv(torch.randn(1, 9), w, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.gemv(torch.randn(1, 8), w, torch.randn(5))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.gemv(torch.randn(1, 4), w.t(), None)


def test_linear_takes_the_gemv_for_one_row_only(ops, monkeypatch) -> None:
    from pdcluster.engine.models import linear as linear_mod

    calls = count_calls(monkeypatch, linear_mod, "_gemv_ops")
    w = torch.randn(6, 8)
    linear_mod.linear(torch.randn(1, 8), w)
    linear_mod.linear(torch.randn(3, 8), w)
    assert [c[0].shape[0] for c in calls] == [1, 3]
    assert linear_mod._gemv_ops(torch.randn(1, 8), w) is ops
    assert linear_mod._gemv_ops(torch.randn(3, 8), w) is None
    assert linear_mod._gemv_ops(torch.randn(1, 8).double(), w.double()) is None


def test_rms_norms_equal_the_reference(ops) -> None:
    from pdcluster.engine.models.llama import RMSNorm

    gen = torch.Generator().manual_seed(4)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96, generator=gen)
    x, residual = torch.randn(5, 96, generator=gen), torch.randn(5, 96, generator=gen)
    with torch.no_grad():
        monkey = kernels.ENABLED
        kernels.ENABLED = False
        try:
            want = norm(x)
            want_add, want_residual = norm.add_forward(x.clone(), residual.clone())
        finally:
            kernels.ENABLED = monkey
        torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-5), want, rtol=1e-5,
                                   atol=1e-6)
        h, r = x.clone(), residual.clone()
        ops.add_rms_norm_(h, r, norm.weight, 1e-5)  # in place: r = r + h, h = norm(r)
        assert torch.equal(r, want_residual)  # the same additions, bit for bit
        torch.testing.assert_close(h, want_add, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="disagree"):
        ops.add_rms_norm_(x, residual[:4].clone(), norm.weight, 1e-5)


def test_rope_and_cache_equal_rotation_and_write(ops) -> None:
    """Bit-identical to the torch RoPE (so to transformers'), and the cache rows hold what
    `PagedKVCache.write` would have written."""
    from pdcluster.engine.models.model_config import RopeConfig
    from pdcluster.engine.models.rope import RotaryEmbedding

    heads, kv_heads, dim, layer = 6, 2, 16, 1
    rope = RotaryEmbedding(RopeConfig(theta=10000.0, rope_type="llama3", factor=8.0,
                                      low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=32), dim, 128)
    spec = KVCacheSpec(8, 3, 4, kv_heads, dim, 4)
    fused, plain = (PagedKVCache(spec, torch.float32, torch.device("cpu")) for _ in range(2))
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim, generator=gen)
    positions = torch.tensor([0, 3, 17, 90, 127])
    slots = fused.slot_rows(torch.tensor([2, 0, 7, 7, 5]), positions % 4)
    want = rope.rotate(positions, qkv[:, : (heads + kv_heads) * dim].view(5, -1, dim))
    v = qkv[:, (heads + kv_heads) * dim :].view(5, kv_heads, dim)
    plain.write(layer, slots, want[:, heads:], v)
    got = qkv.clone()
    ops.rope_and_cache_(got, positions, rope.cos, rope.sin, heads, kv_heads, fused.rows, slots,
                        fused.key_row_offset(layer), spec.block_size, fused.head_stride)
    assert torch.equal(got[:, : (heads + kv_heads) * dim].view(5, -1, dim), want)
    assert torch.equal(got[:, (heads + kv_heads) * dim :], qkv[:, (heads + kv_heads) * dim :])
    assert torch.equal(fused.tensor, plain.tensor)
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        ops.rope_and_cache_(qkv.clone(), torch.tensor([0, 1, 2, 3, 128]), rope.cos, rope.sin,
                            heads, kv_heads, fused.rows, slots, 0, spec.block_size,
                            fused.head_stride)
    with pytest.raises(RuntimeError, match="outside the region"):
        ops.rope_and_cache_(qkv.clone(), positions, rope.cos, rope.sin, heads, kv_heads,
                            fused.rows, slots + 10_000, 0, spec.block_size, fused.head_stride)


def _generate(model_dir: str, prompts, max_tokens: int = 10):
    from pdcluster.engine import LLM, SamplingParams

    llm = LLM(model_dir, num_kv_blocks=128, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-tied-bias-mha", "qwen3-headdim",
                                     "mixtral-4x2", "deepseek-v3-yarn-shared2"])
def test_engine_through_the_kernels_matches_transformers(ops, model_dirs, hf_reference,
                                                         monkeypatch, variant) -> None:
    """Decodes alone and behind a shared cached prefix (the cascade split) take the kernels;
    greedy tokens equal transformers' and the torch paths'. Qwen3 (q/k norms: the torch
    RoPE), Mixtral (MoE) and DeepSeek-V3 (MLA: its absorbed decode reads the latent cache
    through the same kernel, values narrower than keys, instead of gathering it) share the
    layer's fused norms and GEMVs."""
    from pdcluster.engine.models.mla import MLAttention
    from tests.models import random_prompts

    calls = count_calls(monkeypatch, attention, "_kernel_decode_attention")
    gathered = count_calls(monkeypatch, MLAttention, "_gathered_latent_attention")
    model = model_dirs[variant]
    prefix = random_prompts(1, 40, 40, seed=7)[0]
    batches = [[prefix + tail for tail in random_prompts(4, 1, 9, seed=8)],
               random_prompts(3, 3, 20, seed=9)]
    got = [_generate(model, prompts) for prompts in batches]
    mla = variant.startswith("deepseek")
    if mla:
        assert not gathered, "an MLA decode gathered its latents"
    else:
        assert any(meta.cascade is not None for *_, meta, _ in calls), "no cascade step"
        assert any(meta.cascade is None for *_, meta, _ in calls), "no plain decode step"
    for prompts, outs in zip(batches, got, strict=True):
        for prompt, tokens in zip(prompts, outs, strict=True):
            assert tokens == hf_reference(model, prompt, 10)
    monkeypatch.setattr(kernels, "ENABLED", False)
    assert [_generate(model, prompts) for prompts in batches] == got
    assert bool(gathered) == mla  # the torch path gathers


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-tied-bias-mha", "mixtral-4x2"])
def test_a_batch_one_decode_runs_its_layer_stack_as_one_op(ops, model_dirs, hf_reference,
                                                         monkeypatch, variant) -> None:
    """One sequence in decode: plain dense layers go through `decode_layers_` (one C++ call a
    step), with greedy tokens equal to transformers' and the hidden states bit for bit those
    of the per-layer kernels; biases (Qwen2) or experts (Mixtral) keep the per-layer path."""
    from pdcluster.engine.models import llama
    from tests.models import random_prompts

    stacks = count_calls(monkeypatch, llama.DecodeStack, "__call__")
    steps = count_calls(monkeypatch, llama.CausalLM, "forward")
    model = model_dirs[variant]
    prompt = random_prompts(1, 11, 11, seed=5)[0]
    (tokens,) = _generate(model, [prompt], max_tokens=12)
    assert tokens == hf_reference(model, prompt, 12)
    assert len(stacks) == (11 if variant == "llama-gqa" else 0)  # every decode step
    if not stacks:
        return
    # the last step again (it rewrites the same k, v into the same slot), both ways
    causal_lm, input_ids, positions, kv_cache, meta = steps[-1]
    one_op = causal_lm(input_ids, positions, kv_cache, meta)
    monkeypatch.setattr(causal_lm, "_one_op_stack", lambda *args: None)
    per_layer = causal_lm(input_ids, positions, kv_cache, meta)
    assert len(stacks) == 12 and torch.equal(one_op, per_layer)


def test_the_build_command_runs_from_outside_the_checkout(ops, tmp_path) -> None:
    """`python -m pdcluster.engine.kernels`, as setup runs it: found when already built."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PDCLUSTER_CACHE_DIR": str(kernels.library_path().parents[2])}
    proc = subprocess.run([sys.executable, "-m", "pdcluster.engine.kernels"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"engine kernels: {kernels.library_path()}" in proc.stdout
