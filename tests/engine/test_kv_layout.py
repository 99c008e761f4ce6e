"""The KV region's byte layout: one block across all layers (keys and values) is ONE contiguous
byte range, which is what lets a transfer move a request's blocks as a few large descriptors;
and a range of KV heads of one block is one byte range too (tensor-parallel ranks that split
the heads differently move their parts of a block as one descriptor each)."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdcluster.engine import LLMEngine, SamplingParams
from pdcluster.engine.kv.kv_cache import KVCacheSpec, PagedKVCache

CPU = torch.device("cpu")


def make_cache(num_blocks=4, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8,
               dtype=torch.float32) -> PagedKVCache:
    spec = KVCacheSpec(num_blocks, num_layers, block_size, num_kv_heads, head_dim,
                       dtype.itemsize)
    return PagedKVCache(spec, dtype, CPU)


def raw(cache: PagedKVCache) -> torch.Tensor:
    """The whole region as bytes (a view: it sees later writes)."""
    return cache.tensor.view(-1).view(torch.uint8)


def changed_byte_range(before: torch.Tensor, after: torch.Tensor) -> tuple[int, int]:
    changed = (before != after).nonzero().flatten()
    assert changed.numel(), "the write changed no byte"
    return int(changed.min()), int(changed.max()) + 1


@pytest.mark.parametrize("layers, block_size, heads, head_dim, dtype", [
    (2, 16, 2, 16, torch.float32), (3, 4, 1, 32, torch.bfloat16), (1, 1, 8, 8, torch.float16),
])
def test_block_nbytes(layers, block_size, heads, head_dim, dtype) -> None:
    cache = make_cache(5, layers, block_size, heads, head_dim, dtype)
    spec = cache.spec
    assert spec.block_nbytes == layers * 2 * block_size * heads * head_dim * dtype.itemsize
    assert spec.total_nbytes == 5 * spec.block_nbytes == raw(cache).numel()
    assert spec.block_range(3, 2) == (3 * spec.block_nbytes, 2 * spec.block_nbytes)
    assert len(cache.block_bytes(4)) == spec.block_nbytes


def test_each_block_is_one_contiguous_byte_range() -> None:
    cache = make_cache(num_blocks=6, dtype=torch.bfloat16)
    nbytes, base = cache.spec.block_nbytes, cache.data_ptr()
    assert cache.tensor.is_contiguous()
    for b in range(6):
        block = cache.tensor[b]
        assert block.is_contiguous()
        assert block.data_ptr() == base + b * nbytes == base + cache.spec.block_range(b)[0]
        assert block.numel() * block.element_size() == nbytes
    assert cache.tensor[1:4].is_contiguous()  # consecutive blocks: one range too


def test_a_range_of_heads_of_a_block_is_one_byte_range() -> None:
    cache = make_cache(num_blocks=3, num_layers=3, block_size=4, num_kv_heads=4, head_dim=8)
    region, spec = raw(cache), cache.spec
    for first, count in ((0, 4), (1, 2), (3, 1)):
        offset, length = spec.head_range(2, first, count)
        before = region.clone()
        for layer in range(3):
            keys, values = cache.layer_kv(layer)
            keys[2, :, first:first + count] = 1.0
            values[2, :, first:first + count] = 2.0
        outside = torch.ones_like(region, dtype=torch.bool)
        outside[offset:offset + length] = False
        assert torch.equal(region[outside], before[outside])  # nothing beyond the range
        heads = cache.tensor[2, first:first + count]  # every layer's keys and values of them
        assert heads.is_contiguous() and heads.data_ptr() == cache.data_ptr() + offset
        assert heads.numel() * heads.element_size() == length and heads.all()
        cache.tensor.zero_()


def test_layer_views_write_inside_their_block_only() -> None:
    cache = make_cache(num_blocks=3, block_size=2, num_kv_heads=1, head_dim=2)
    nbytes, region = cache.spec.block_nbytes, raw(cache)
    seen = set()
    for layer, kv, block, offset in itertools.product(range(2), range(2), range(3), range(2)):
        view = cache.layer_kv(layer)[kv]
        assert view.shape == (3, 2, 1, 2) and view.data_ptr() >= cache.data_ptr()
        before = region.clone()
        view[block, offset] = 1.0
        start, end = changed_byte_range(before, region)
        assert block * nbytes <= start < end <= (block + 1) * nbytes
        seen.add(start)
        view[block, offset] = 0.0
    assert len(seen) == 2 * 2 * 3 * 2, "two slots share bytes"
    assert not region.any()


def test_write_stores_each_token_in_its_layer_slot() -> None:
    cache = make_cache(num_blocks=5, num_layers=3)
    gen = torch.Generator().manual_seed(0)
    blocks, offsets = torch.tensor([3, 0, 3, 4, 1]), torch.tensor([1, 0, 3, 2, 3])
    rows = cache.slot_rows(blocks, offsets)
    for layer in range(3):
        before = raw(cache).clone()
        k, v = torch.randn(2, 5, 2, 8, generator=gen).unbind(0)
        cache.write(layer, rows, k, v)
        keys, values = cache.layer_kv(layer)
        assert torch.equal(keys[blocks, offsets], k) and torch.equal(values[blocks, offsets], v)
        changed = (before != raw(cache)).view(5, -1).any(dim=1)
        assert changed.nonzero().flatten().tolist() == sorted(set(blocks.tolist()))
    assert int((cache.tensor != 0).sum()) == 3 * 2 * 5 * 2 * 8  # nothing else touched


def hf_keys_values(model_dir: str, token_ids: list[int]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        cache = model(torch.tensor([token_ids]), use_cache=True).past_key_values
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]  # [Hkv, T, D] each


def test_engine_blocks_hold_the_request_kv(model_dirs) -> None:
    model_dir = model_dirs["llama-gqa"]
    engine = LLMEngine.from_model(model_dir, num_kv_blocks=6, block_size=4, dtype="float32")
    prompt = [1, 345, 678, 910, 1112]
    engine.add_request("r", prompt, SamplingParams(max_tokens=2, temperature=0.0,
                                                   ignore_eos=True))
    engine.step()
    block_ids = engine.kv_manager.block_ids("r")
    (out,) = engine.step()
    assert out.finished and len(block_ids) == 2
    computed = prompt + out.token_ids[:1]  # 6 tokens: block 0 full, block 1 slots 0-1
    cache, nbytes = engine.kv_cache, engine.kv_spec.block_nbytes
    for b in range(engine.kv_spec.num_blocks):
        if b not in block_ids:
            assert cache.block_bytes(b) == bytes(nbytes), f"untouched block {b} changed"
    for layer, (hf_k, hf_v) in enumerate(hf_keys_values(model_dir, computed)):
        keys, values = cache.layer_kv(layer)
        for ours, ref in ((keys, hf_k), (values, hf_v)):
            slots = torch.cat([ours[block_ids[0]], ours[block_ids[1], :2]])  # [6, Hkv, D]
            torch.testing.assert_close(slots, ref.transpose(0, 1), rtol=1e-4, atol=1e-5)
            assert not ours[block_ids[1], 2:].any(), "slots past the computed tokens written"
    region = raw(cache)
    before = region.clone()
    cache.layer_kv(1)[1][block_ids[1], 3] = 7.0
    start, end = changed_byte_range(before, region)
    assert block_ids[1] * nbytes <= start < end <= (block_ids[1] + 1) * nbytes
