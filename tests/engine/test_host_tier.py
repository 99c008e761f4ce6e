"""The engine's host KV tier on real models: prefixes the device evicted come back from the host
and the greedy tokens stay exactly transformers' — alone, in batches, in chunked prefill and
under preemption — with both pools leak-free after every scenario; and tier sizes that cannot
work are refused when the engine starts."""

from __future__ import annotations

import pytest

from pdcluster.engine import LLM, SamplingParams
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.kv.host_kv_cache import host_tier_blocks
from tests.helpers import assert_tiers_clean
from tests.models import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def make_llm(model_dir: str, num_kv_blocks: int = 16, num_host_blocks: int = 64,
             **options) -> LLM:
    return LLM(model_dir, num_kv_blocks=num_kv_blocks, block_size=8,
               num_host_blocks=num_host_blocks, **options)


def check(llm: LLM, model_dir: str, prompts: list[list[int]], hf_reference,
          params: SamplingParams = GREEDY) -> list:
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_reference(model_dir, prompt, params.max_tokens), \
            f"diverged for a {len(prompt)}-token prompt"
    assert_tiers_clean(llm.engine.tiers)
    return outs


def evict_with(llm: LLM, seed: int, n: int = 3) -> None:
    """Fill the device with unrelated prompts, so earlier prefixes move to the host."""
    llm.generate(random_prompts(n, 100, 110, seed=seed), SamplingParams(max_tokens=1))


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-tied-bias-mha",
                                     "deepseek-v2-qlora-grouped"])
def test_a_prefix_served_from_the_host_gives_the_same_tokens(variant, model_dirs,
                                                              hf_reference):
    model_dir = model_dirs[variant]
    llm = make_llm(model_dir)
    prefix = random_prompts(1, 72, 72, seed=11)[0]
    check(llm, model_dir, [prefix + [7]], hf_reference)
    evict_with(llm, seed=12)
    tiers = llm.engine.tiers
    assert tiers.num_demoted >= 9  # the prefix's 9 full blocks at least
    out = check(llm, model_dir, [prefix + [9, 10]], hf_reference)[0]
    assert out.num_cached_tokens == 72  # all 9 blocks, loaded from the host
    assert tiers.num_loaded >= 9


def test_a_batch_sharing_a_host_prefix(model_dirs, hf_reference):
    model_dir = model_dirs["llama-gqa"]
    llm = make_llm(model_dir, num_kv_blocks=40)
    prefix = random_prompts(1, 64, 64, seed=13)[0]
    check(llm, model_dir, [prefix + [5]], hf_reference)
    evict_with(llm, seed=14, n=5)
    prompts = [prefix + tail for tail in random_prompts(5, 1, 12, seed=15)]
    outs = check(llm, model_dir, prompts, hf_reference)
    # the first admitted loads the prefix back; the rest hit it on the device
    assert all(out.num_cached_tokens == 64 for out in outs)


@pytest.mark.parametrize("budget", [5, 13])
def test_chunked_prefill_after_a_host_hit(budget, model_dirs, hf_reference):
    model_dir = model_dirs["llama-gqa"]
    llm = make_llm(model_dir, max_num_batched_tokens=budget)
    prefix = random_prompts(1, 48, 48, seed=16)[0]
    check(llm, model_dir, [prefix + [3]], hf_reference)
    evict_with(llm, seed=17)
    check(llm, model_dir, [prefix + tail for tail in random_prompts(2, 9, 30, seed=18)],
          hf_reference)
    assert llm.engine.tiers.num_loaded >= 6


def test_preempted_requests_come_back_from_the_host(model_dirs, hf_reference):
    model_dir = model_dirs["llama-gqa"]
    llm = LLM(model_dir, num_kv_blocks=14, block_size=4, max_num_batched_tokens=32,
              num_host_blocks=64)
    prompts = random_prompts(8, 6, 30, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    check(llm, model_dir, prompts, hf_reference, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.tiers.num_loaded > 0  # a preempted request reloaded what it had


def test_reset_and_events_cover_both_tiers(model_dirs):
    llm = make_llm(model_dirs["llama-gqa"], enable_kv_events=True)
    llm.generate(random_prompts(4, 100, 110, seed=19), SamplingParams(max_tokens=1))
    engine = llm.engine
    events = engine.take_kv_events()
    kinds = {type(e).__name__ for e in events}
    assert {"BlockStored", "BlockMoved"} <= kinds
    host = set(engine.tiers.host.cached_hashes())
    assert host and host <= set(engine.cached_block_hashes())
    assert engine.stats()["num_host_cached"] == len(host)
    assert engine.reset_prefix_cache()
    assert engine.cached_block_hashes() == []
    assert type(engine.take_kv_events()[-1]).__name__ == "AllBlocksCleared"


def test_tier_sizes_that_cannot_work_are_refused(model_dirs):
    with pytest.raises(ValueError, match="host KV tier does not fit"):
        host_tier_blocks(4096.0, None, 2**20, available=8 * 2**30)
    with pytest.raises(ValueError, match="holds no KV block"):
        host_tier_blocks(1e-9, None, 2**20, available=None)
    assert host_tier_blocks(0.0, None, 2**20, available=None) == 0
    assert host_tier_blocks(1.0, None, 2**20, available=None) == 1024
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        EngineConfig(model="m", host_cache_gib=1.0, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="host_cache_gib must be >= 0"):
        EngineConfig(model="m", host_cache_gib=-1.0)
    with pytest.raises(ValueError, match="vLLM"):
        EngineConfig(model="m", backend="vllm", host_cache_gib=1.0)
    with pytest.raises(ValueError, match="host KV tier does not fit"):
        LLM(model_dirs["llama-gqa"], num_kv_blocks=16, host_cache_gib=1e6)


def test_available_host_memory_is_capped_by_the_cgroup(tmp_path):
    from pdcluster.engine.kv.host_kv_cache import available_host_bytes

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  67108864 kB\nMemAvailable:  33554432 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert available_host_bytes(meminfo, cgroup) == 32 * 2**30  # no cgroup files: the system's
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text(str(2**30))
    assert available_host_bytes(meminfo, cgroup) == 32 * 2**30  # no limit
    (cgroup / "memory.max").write_text(str(8 * 2**30))
    assert available_host_bytes(meminfo, cgroup) == 7 * 2**30  # the pod's limit, less its use
    assert available_host_bytes(tmp_path / "none", tmp_path / "none") is None
