"""The engine's C++ kernels (engine/kernels): built here with the machine's compiler when setup
has not built them, checked against plain softmax attention, their errors, the engine's greedy
tokens through them against transformers' and against the torch paths, and the fallback when
they are missing or turned off."""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")

from pdcluster.engine import attention, kernels  # noqa: E402
from pdcluster.engine.kv_cache import KVCacheSpec, PagedKVCache  # noqa: E402
from tests.helpers import count_calls  # noqa: E402


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
    out, lse = torch.zeros_like(q), torch.full((seqs, heads, rows), float("-inf"))
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


def _generate(model_dir: str, prompts, max_tokens: int = 10):
    from pdcluster.engine import LLM, SamplingParams

    llm = LLM(model_dir, num_kv_blocks=128, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-tied-bias-mha"])
def test_engine_through_the_kernel_matches_transformers(ops, model_dirs, hf_reference,
                                                        monkeypatch, variant) -> None:
    """Decodes alone and behind a shared cached prefix (the cascade split) take the kernel;
    greedy tokens equal transformers' and the torch path's."""
    from tests.models import random_prompts

    calls = count_calls(monkeypatch, attention, "_kernel_decode_attention")
    model = model_dirs[variant]
    prefix = random_prompts(1, 40, 40, seed=7)[0]
    batches = [[prefix + tail for tail in random_prompts(4, 1, 9, seed=8)],
               random_prompts(3, 3, 20, seed=9)]
    got = [_generate(model, prompts) for prompts in batches]
    assert any(meta.cascade is not None for *_, meta, _ in calls), "no cascade step"
    assert any(meta.cascade is None for *_, meta, _ in calls), "no plain decode step"
    for prompts, outs in zip(batches, got, strict=True):
        for prompt, tokens in zip(prompts, outs, strict=True):
            assert tokens == hf_reference(model, prompt, 10)
    monkeypatch.setattr(kernels, "ENABLED", False)
    assert [_generate(model, prompts) for prompts in batches] == got


def test_without_the_library_the_engine_takes_its_torch_paths(model_dirs, tmp_path,
                                                              monkeypatch) -> None:
    from tests.models import random_prompts

    built_under = kernels.library_path().parents[2]
    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(tmp_path))  # nothing built there
    kernels.ops.cache_clear()
    try:
        assert kernels.ops() is None
        calls = count_calls(monkeypatch, attention, "_batched_decode_attention")
        assert len(_generate(model_dirs["llama-gqa"], random_prompts(2, 3, 9, seed=3))[0]) == 10
        assert calls
        monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(built_under))
        monkeypatch.setenv(kernels.DISABLE_ENV, "0")
        kernels.ops.cache_clear()
        assert kernels.ops() is None  # turned off even where built
    finally:
        kernels.ops.cache_clear()


def test_a_failing_compiler_is_reported_not_raised(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # exists, always fails
    assert kernels.main() == 1
    err = capsys.readouterr().err
    assert "building the engine's kernels failed" in err and "torch paths" in err
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert kernels.main() == 1
    assert "no C++ compiler" in capsys.readouterr().err
    assert not kernels.library_path().exists()
