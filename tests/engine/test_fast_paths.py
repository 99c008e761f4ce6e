"""The engine's CPU fast paths against their plain-torch definitions: oneDNN linears and the
SwiGLU epilogues (engine/models/linear.py), and attention's reused gather buffers
(engine/models/attention.py). The exact-greedy tests (test_hf_parity.py, test_real_model.py) check
the same paths end to end against transformers."""

from __future__ import annotations

import pytest
import torch

from pdcluster.engine.kernels import gemm
from pdcluster.engine.kv.kv_cache import KVCacheSpec, PagedKVCache
from pdcluster.engine.models import linear as linear_mod
from pdcluster.engine.models.attention_meta import GatherWorkspace
from pdcluster.engine.models.linear import Linear, linear, silu_and_mul
from tests.helpers import count_calls

F = torch.nn.functional
CPU = torch.device("cpu")
onednn = pytest.mark.skipif(not linear_mod._ONEDNN, reason="torch built without oneDNN")


@pytest.fixture(params=[True, False], ids=["onednn", "f_linear"])
def backend(request, monkeypatch):
    """Run a test on the oneDNN path and on the F.linear fallback (CUDA, or no oneDNN); the
    engine's GEMV for single rows is off here (tests/engine/test_kernels.py covers it)."""
    from pdcluster.engine import kernels

    if request.param and not linear_mod._ONEDNN:
        pytest.skip("torch built without oneDNN")
    monkeypatch.setattr(linear_mod, "_ONEDNN", request.param)
    monkeypatch.setattr(gemm, "choice", lambda: dict(gemm.DEFAULT))  # oneDNN where on
    monkeypatch.setattr(kernels, "ENABLED", False)
    return request.param


@pytest.mark.parametrize("shape", [(5, 48), (2, 3, 48), (0, 48), (1, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_f_linear(backend, shape, bias) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen)
    w = torch.randn(40, 48, generator=gen)
    b = torch.randn(40, generator=gen) if bias else None
    got = linear(x, w, b)
    assert got.shape == (*shape[:-1], 40)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_takes_strided_inputs(backend) -> None:
    """Attention hands o_proj a reshaped view and MLA slices fused projections."""
    x = torch.randn(6, 96)[:, ::2]
    w = torch.randn(48, 40).t()  # a transposed view, not contiguous
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_linear_module_keeps_nn_linear_parameters() -> None:
    layer = Linear(8, 4, bias=True)
    assert isinstance(layer, torch.nn.Linear)
    assert set(dict(layer.named_parameters())) == {"weight", "bias"}
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_silu_and_mul_is_swiglu(backend, rows, bias) -> None:
    gen = torch.Generator().manual_seed(1)
    hidden, inter = 32, 24
    x = torch.randn(rows, hidden, generator=gen)
    w = torch.randn(2 * inter, hidden, generator=gen) / hidden**0.5
    b = torch.randn(2 * inter, generator=gen) if bias else None
    gate, up = F.linear(x, w, b).split(inter, dim=-1)
    torch.testing.assert_close(silu_and_mul(x, w, b, inter), F.silu(gate) * up,
                               rtol=1e-5, atol=1e-6)


@onednn
def test_onednn_path_is_taken(monkeypatch) -> None:
    """The fast path really runs on CPU float32 (a silent fallback would pass the tests
    above and lose the speed) where the calibration chose it."""
    monkeypatch.setattr(gemm, "choice", lambda: dict(gemm.DEFAULT))
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        def __call__(self, *args):
            calls.append(args[3])
            return real(*args)

        binary = real.binary

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", Spy())
    linear(torch.randn(2, 8), torch.randn(4, 8))
    silu_and_mul(torch.randn(2, 8), torch.randn(6, 8), None, 3)
    assert calls == ["none", "swish"]


def _cache() -> PagedKVCache:
    spec = KVCacheSpec(num_blocks=6, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8,
                       dtype_nbytes=4)
    cache = PagedKVCache(spec, torch.float32, torch.device("cpu"))
    cache.tensor.copy_(torch.randn(cache.tensor.shape))
    return cache


def _reference(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[..., n] -> [..., Hkv, n * bs, D] by plain indexing."""
    blocks = cache[block_ids]  # [..., n, bs, Hkv, D]
    return blocks.flatten(-4, -3).transpose(-3, -2)


def test_gather_matches_indexing_and_reuses_its_buffer() -> None:
    cache = _cache()
    keys, values = cache.layer_kv(1)
    workspace = GatherWorkspace()
    table = torch.tensor([[3, 1, 5], [0, 2, 2]])
    got_k = workspace.gather(keys, table, GatherWorkspace.KEYS)
    got_v = workspace.gather(values, table, GatherWorkspace.VALUES)
    assert torch.equal(got_k, _reference(keys, table))
    assert torch.equal(got_v, _reference(values, table))  # keys were not overwritten by values
    assert torch.equal(got_k, _reference(keys, table))
    first = got_k.data_ptr()
    smaller = workspace.gather(keys, torch.tensor([4, 0]), GatherWorkspace.KEYS)
    assert smaller.data_ptr() == first  # the same memory: no fresh allocation per gather
    assert torch.equal(smaller, _reference(keys, torch.tensor([4, 0])))


def test_gather_grows_for_a_larger_batch() -> None:
    cache = _cache()
    keys, _ = cache.layer_kv(0)
    workspace = GatherWorkspace()
    workspace.gather(keys, torch.tensor([1]), GatherWorkspace.KEYS)
    table = torch.tensor([[0, 1, 2, 3, 4, 5]] * 3)
    assert torch.equal(workspace.gather(keys, table, GatherWorkspace.KEYS),
                       _reference(keys, table))


# ---- cascade decode attention (shared leading blocks read once for the batch) ---------------


def _decode_meta(cache: PagedKVCache, tables: list[list[int]], lens: list[int],
                 runner_cascade: bool):
    """Attention metadata for one decode token per table, built by the model runner's own
    table code (with or without the cascade split)."""
    from pdcluster.engine.models.attention_meta import AttentionMetadata
    from pdcluster.engine.runner.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)  # only the table helpers: no model needed
    runner.block_size, runner.kv_cache, runner.device = cache.spec.block_size, cache, CPU
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    lens_t = torch.tensor(lens)
    cascade = runner._cascade(table, lens_t) if runner_cascade else None
    return AttentionMetadata(torch.zeros(len(tables), dtype=torch.long), len(tables), table,
                             lens_t, [], GatherWorkspace(), cascade)



def _big_cache(num_blocks=24, block_size=4, kv_heads=2, head_dim=16) -> PagedKVCache:
    spec = KVCacheSpec(num_blocks, 1, block_size, kv_heads, head_dim, 4)
    cache = PagedKVCache(spec, torch.float32, CPU)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=torch.Generator().manual_seed(2)))
    return cache


def test_cascade_equals_one_batched_softmax() -> None:
    from pdcluster.engine.models import attention

    cache = _big_cache()
    shared = [3, 7, 1, 9, 4]
    tables = [shared + [10, 11], shared + [12], shared + [13, 14, 15]]
    lens = [26, 21, 31]  # every context covers the 5 shared blocks (20 tokens) whole
    plain = _decode_meta(cache, tables, lens, runner_cascade=False)
    split = _decode_meta(cache, tables, lens, runner_cascade=True)
    assert split.cascade is not None
    assert split.cascade.shared_block_ids.tolist() == shared
    q = torch.randn(3, 6, 16)  # 6 query heads over 2 KV heads
    k_cache, v_cache = cache.layer_kv(0)
    want = attention._batched_decode_attention(q, k_cache, v_cache, plain, 0.25)
    got = attention._cascade_decode_attention(q, k_cache, v_cache, split, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the CPU kernel and the path other devices take agree on outputs and log-sum-exps
    rows = q.view(3, 2, 3, 16)
    own_k = split.workspace.gather(k_cache, split.cascade.block_table, GatherWorkspace.KEYS)
    own_v = split.workspace.gather(v_cache, split.cascade.block_table, GatherWorkspace.VALUES)
    cpu_out, cpu_lse = attention._attend(rows, own_k, own_v, split.cascade.bias, 0.25)
    mm_out, mm_lse = attention._attend_matmul(rows, own_k, own_v, split.cascade.bias, 0.25)
    torch.testing.assert_close(cpu_lse, mm_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_out, mm_out, rtol=1e-5, atol=1e-6)
    scores = torch.matmul(rows, own_k.transpose(-1, -2)) * 0.25 + split.cascade.bias
    torch.testing.assert_close(mm_lse, torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tables, lens, shared", [
    ([[1, 2, 3, 4, 5]], [20], None),  # one sequence: nothing to share
    ([[1, 2, 3, 5], [1, 2, 3, 6]], [16, 16], None),  # 3 shared blocks: below the minimum
    ([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]], [18, 19], [1, 2, 3, 4]),
    # block 5 is in both tables but the first context ends inside it: not shared
    ([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 7]], [17, 23], [1, 2, 3, 4]),
    ([[1, 2, 3, 4, 5], [1, 9, 3, 4, 5]], [20, 20], None),  # differs at block 2
])
def test_cascade_takes_only_blocks_every_context_covers(tables, lens, shared) -> None:
    from pdcluster.engine.runner.model_runner import MIN_SHARED_BLOCKS

    assert MIN_SHARED_BLOCKS == 4  # the cases above are written for it
    meta = _decode_meta(_big_cache(), tables, lens, runner_cascade=True)
    got = None if meta.cascade is None else meta.cascade.shared_block_ids.tolist()
    assert got == shared
    if shared:
        own = meta.cascade.bias[:, 0, 0] == 0
        assert own.sum(1).tolist() == [n - 4 * len(shared) for n in lens]


def test_decodes_sharing_a_prompt_prefix_match_transformers(model_dirs, hf_reference,
                                                            monkeypatch) -> None:
    """End to end: decodes behind a shared cached prefix take the cascade path, and their
    greedy tokens still equal transformers'. (The torch path; tests/engine/test_kernels.py
    runs the same with the engine's C++ kernel.)"""
    from pdcluster.engine import LLM, SamplingParams, kernels
    from pdcluster.engine.models import attention
    from tests.models import random_prompts

    monkeypatch.setattr(kernels, "ENABLED", False)
    calls = count_calls(monkeypatch, attention, "_cascade_decode_attention")
    model = model_dirs["llama-gqa"]
    llm = LLM(model, num_kv_blocks=128, block_size=4)
    prefix = random_prompts(1, 40, 40, seed=7)[0]
    prompts = [prefix + tail for tail in random_prompts(4, 1, 9, seed=8)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert calls, "the shared prefix did not take the cascade path"
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_reference(model, prompt, 10)


# ---- a long chunk after earlier tokens: two flash calls merged (CPU) --------------------------


@pytest.mark.parametrize("earlier, own", [(1, 512), (37, 600), (512, 520)])
def test_split_prefill_equals_one_masked_call(earlier, own) -> None:
    """block_size 4; `earlier` need not end on a block boundary (a mid-block chunk start)."""
    from pdcluster.engine.models import attention
    from pdcluster.engine.models.attention_meta import PrefillChunk

    bs, kv_heads, dim = 4, 2, 16
    total = earlier + own
    cache = _big_cache(num_blocks=-(-total // bs) + 3, block_size=bs, kv_heads=kv_heads,
                       head_dim=dim)
    k_cache, v_cache = cache.layer_kv(0)
    block_ids = torch.randperm(k_cache.shape[0])[: -(-total // bs)]
    # the chunk's own keys/values as the cache holds them after this step's write
    flat_k = k_cache[block_ids].flatten(0, 1)[:total]
    flat_v = v_cache[block_ids].flatten(0, 1)[:total]
    k, v = flat_k[earlier:], flat_v[earlier:]
    q = torch.randn(own, 3 * kv_heads, dim)
    positions = torch.arange(earlier, total)
    mask = torch.arange(total)[None, :] <= positions[:, None]
    chunk = PrefillChunk(0, own, total, block_ids)
    assert torch.equal(chunk.mask, mask)
    assert own >= attention.MIN_SPLIT_CHUNK
    got = attention._prefill_attention(q, k, v, k_cache, v_cache, chunk, 0.25,
                                       GatherWorkspace())
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[None],
                                          flat_k.transpose(0, 1)[None],
                                          flat_v.transpose(0, 1)[None], attn_mask=mask,
                                          scale=0.25, enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_long_chunk_after_a_cached_prefix_matches_transformers(model_dirs, hf_reference,
                                                               monkeypatch) -> None:
    from pdcluster.engine import LLM, SamplingParams
    from pdcluster.engine.models import attention
    from tests.models import random_prompts

    calls = count_calls(monkeypatch, attention, "_split_prefill_attention")
    model = model_dirs["llama-gqa"]
    llm = LLM(model, device="cpu", dtype="float32", num_kv_blocks=256, block_size=8)  # CPU path
    prefix = random_prompts(1, 50, 50, seed=9)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate([prefix], params)  # caches the prefix's 6 full blocks
    prompt = prefix + random_prompts(1, 600, 600, seed=10)[0]
    out = llm.generate([prompt], params)[0]
    assert out.num_cached_tokens == 48
    assert calls, "the 602-token chunk after the cached prefix did not take the split path"
    assert out.token_ids == hf_reference(model, prompt, 6)
