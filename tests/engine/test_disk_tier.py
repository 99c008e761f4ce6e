"""The engine's disk KV tier on real models: prefixes pushed through the host down to disk
come back from the file and the greedy tokens stay exactly transformers' — alone, in
batches, in chunked prefill and under preemption — with every pool leak-free after each
scenario; a restarted node never serves a stale block (the file is wiped); a stalled writer
drops spills instead of stalling the step; the events give the index each block's media and
the router prices a disk load from the node's measured reads; sizes that cannot work are
refused at start."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

import pytest

from pdcluster.core.block_index import BlockIndex, apply_events
from pdcluster.core.events import DISK, HOST, BlockMoved
from pdcluster.core.paths import UnsafeDirectory
from pdcluster.engine import LLM, SamplingParams
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.kv.disk_kv_cache import DiskKVCache, disk_tier_blocks
from pdcluster.router.routing.policy import NodeView, PolicyConfig
from pdcluster.router.routing.tier_costs import tier_cost
from tests.helpers import assert_tiers_clean
from tests.models import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def make_llm(tmp_path):
    made: list[LLM] = []

    def make(model_dir: str, num_kv_blocks: int = 16, num_host_blocks: int = 16,
             num_disk_blocks: int = 64, **options) -> LLM:
        options.setdefault("disk_cache_dir", str(tmp_path / "kv"))
        llm = LLM(model_dir, num_kv_blocks=num_kv_blocks, block_size=8,
                  num_host_blocks=num_host_blocks, num_disk_blocks=num_disk_blocks, **options)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.engine.close()


def settle(llm: LLM) -> None:
    """Let the writer finish and the bookkeeping hear of it (as the next step would)."""
    engine = llm.engine
    assert engine.host_cache.disk.drain()
    engine.host_cache.collect(engine.tiers)


def check(llm: LLM, model_dir: str, prompts: list[list[int]], hf_reference,
          params: SamplingParams = GREEDY) -> list:
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_reference(model_dir, prompt, params.max_tokens), \
            f"diverged for a {len(prompt)}-token prompt"
    settle(llm)
    assert_tiers_clean(llm.engine.tiers)
    return outs


def push_to_disk(llm: LLM, seed: int, n: int = 4) -> None:
    """Unrelated prompts through the device and the (small) host: earlier prefixes end on
    the disk."""
    llm.generate(random_prompts(n, 100, 110, seed=seed), SamplingParams(max_tokens=1))
    settle(llm)


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-tied-bias-mha"])
def test_a_prefix_served_from_the_disk_gives_the_same_tokens(variant, model_dirs,
                                                              hf_reference, make_llm):
    model_dir = model_dirs[variant]
    llm = make_llm(model_dir)
    prefix = random_prompts(1, 72, 72, seed=21)[0]
    check(llm, model_dir, [prefix + [7]], hf_reference)
    push_to_disk(llm, seed=22)
    tiers = llm.engine.tiers
    assert tiers.num_spilled >= 9
    out = check(llm, model_dir, [prefix + [9, 10]], hf_reference)[0]
    assert out.num_cached_tokens == 72  # all 9 blocks, loaded back
    assert tiers.num_disk_loaded >= 9


def test_a_batch_sharing_a_disk_prefix(model_dirs, hf_reference, make_llm):
    model_dir = model_dirs["llama-gqa"]
    llm = make_llm(model_dir, num_kv_blocks=40)
    prefix = random_prompts(1, 64, 64, seed=23)[0]
    check(llm, model_dir, [prefix + [5]], hf_reference)
    push_to_disk(llm, seed=24, n=6)
    prompts = [prefix + tail for tail in random_prompts(5, 1, 12, seed=25)]
    outs = check(llm, model_dir, prompts, hf_reference)
    assert all(out.num_cached_tokens == 64 for out in outs)
    assert llm.engine.tiers.num_disk_loaded >= 8


@pytest.mark.parametrize("budget", [5, 13])
def test_chunked_prefill_after_a_disk_hit(budget, model_dirs, hf_reference, make_llm):
    model_dir = model_dirs["llama-gqa"]
    llm = make_llm(model_dir, max_num_batched_tokens=budget)
    prefix = random_prompts(1, 48, 48, seed=26)[0]
    check(llm, model_dir, [prefix + [3]], hf_reference)
    push_to_disk(llm, seed=27)
    check(llm, model_dir, [prefix + tail for tail in random_prompts(2, 9, 30, seed=28)],
          hf_reference)
    assert llm.engine.tiers.num_disk_loaded >= 6


def test_preempted_requests_come_back_through_the_disk(model_dirs, hf_reference, tmp_path):
    model_dir = model_dirs["llama-gqa"]
    llm = LLM(model_dir, num_kv_blocks=14, block_size=4, max_num_batched_tokens=32,
              num_host_blocks=2, num_disk_blocks=64, disk_cache_dir=str(tmp_path))
    try:
        prompts = random_prompts(8, 6, 30, seed=6)
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        check(llm, model_dir, prompts, hf_reference, params)
        engine = llm.engine
        assert engine.scheduler.num_preemptions > 0
        assert engine.tiers.num_spilled > 0 and engine.tiers.num_loaded > 0
    finally:
        llm.engine.close()


def test_a_restarted_node_never_serves_stale_disk_blocks(model_dirs, hf_reference, tmp_path):
    model_dir = model_dirs["llama-gqa"]
    folder = tmp_path / "kv" / "kv-disk"  # the tier's own subfolder of disk_cache_dir
    folder.mkdir(parents=True, mode=0o700)
    stale = folder / "kv-1-dead.bin"  # what a crashed engine left (nobody holds its lock)
    stale.write_bytes(b"\x7f" * 4096)
    options = dict(num_kv_blocks=16, block_size=8, num_host_blocks=16, num_disk_blocks=64,
                   disk_cache_dir=str(folder.parent))
    llm = LLM(model_dir, **options)
    assert not stale.exists()
    prefix = random_prompts(1, 72, 72, seed=29)[0]
    check(llm, model_dir, [prefix + [7]], hf_reference)
    push_to_disk(llm, seed=30)
    assert llm.engine.tiers.disk.num_cached >= 9
    first_file = llm.engine.host_cache.disk.path
    restarted = LLM(model_dir, **options)  # the first one still holds its file: kept
    assert first_file.exists() and restarted.engine.host_cache.disk.path != first_file
    llm.engine.close()
    assert not first_file.exists()
    try:
        assert restarted.engine.tiers.disk.num_cached == 0
        out = check(restarted, model_dir, [prefix + [9, 10]], hf_reference)[0]
        assert out.num_cached_tokens == 0  # recomputed: nothing from before the restart
        assert restarted.engine.tiers.num_disk_loaded == 0
    finally:
        restarted.engine.close()
    assert list(folder.glob("kv-*.bin")) == []


def test_a_stalled_writer_drops_spills_and_never_blocks_the_step(model_dirs, hf_reference,
                                                                 make_llm, monkeypatch):
    model_dir = model_dirs["llama-gqa"]
    baseline = make_llm(model_dir, num_host_blocks=2)
    prompts = random_prompts(4, 100, 110, seed=31)
    started = time.perf_counter()
    baseline.generate(prompts, SamplingParams(max_tokens=1))
    baseline_s = time.perf_counter() - started
    llm = make_llm(model_dir, num_host_blocks=2, disk_max_pending_writes=2)
    release = threading.Event()
    real_pwrite = os.pwrite

    def stalled_pwrite(fd, data, offset):
        release.wait(60)  # the disk hangs until the test lets it go
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", stalled_pwrite)
    try:
        started = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1))
        stalled_s = time.perf_counter() - started
        tiers = llm.engine.tiers
        assert tiers.num_pending_spills == 2 and tiers.num_spills_dropped > 0
        assert stalled_s < 5 * baseline_s + 5.0, (stalled_s, baseline_s)
    finally:
        release.set()
    settle(llm)
    assert tiers.num_pending_spills == 0
    check(llm, model_dir, prompts[:1], hf_reference)


def test_failed_writes_are_forgotten_and_the_prefix_recomputed(model_dirs, hf_reference,
                                                               make_llm, monkeypatch):
    model_dir = model_dirs["llama-gqa"]
    llm = make_llm(model_dir, enable_kv_events=True)

    def full_disk(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full_disk)
    prefix = random_prompts(1, 72, 72, seed=35)[0]
    check(llm, model_dir, [prefix + [7]], hf_reference)
    push_to_disk(llm, seed=36)
    engine = llm.engine
    disk = engine.host_cache.disk
    assert engine.tiers.num_spilled > 0 and disk.num_write_errors == engine.tiers.num_spilled
    assert engine.tiers.disk.num_cached == 0  # nothing the index was told stays claimed
    index = BlockIndex()
    index.add_node("n")
    apply_events(index, "n", engine.take_kv_events())
    assert index.node_blocks("n") == set(engine.cached_block_media())
    out = check(llm, model_dir, [prefix + [9, 10]], hf_reference)[0]
    assert out.num_cached_tokens == 0 and engine.tiers.num_disk_loaded == 0


def test_events_give_the_index_every_tier(model_dirs, make_llm):
    llm = make_llm(model_dirs["llama-gqa"], num_host_blocks=4, enable_kv_events=True)
    llm.generate(random_prompts(6, 100, 110, seed=32), SamplingParams(max_tokens=1))
    settle(llm)
    engine = llm.engine
    events = engine.take_kv_events()
    assert any(isinstance(e, BlockMoved) and (e.src, e.dst) == (HOST, DISK) for e in events)
    index = BlockIndex()
    index.add_node("n")
    apply_events(index, "n", events)
    media = engine.cached_block_media()
    assert index.node_blocks("n") == set(media)
    on_disk = [h for h, mask in media.items() if mask == 4]
    assert on_disk and index.lower_tiers("n", on_disk) == (0, len(on_disk))
    assert engine.stats()["num_disk_cached"] == engine.tiers.disk.num_cached
    costs = engine.kv_costs()
    assert costs is not None and costs.disk_bytes_per_s > 0 and costs.host_bytes_per_s > 0
    # the router prices this node's disk blocks from what it measured, not a fallback
    config = PolicyConfig(block_size=8)
    node = NodeView("n", cached_blocks=len(on_disk), disk_blocks=len(on_disk), costs=costs)
    seconds = costs.disk_latency_s + \
        len(on_disk) * 8 * costs.kv_bytes_per_token / costs.disk_bytes_per_s
    assert tier_cost(node, config) == pytest.approx(
        config.prefill_weight * seconds * costs.prefill_tokens_per_s)
    assert engine.reset_prefix_cache()
    assert engine.cached_block_hashes() == [] and engine.tiers.disk.num_cached == 0


def test_disk_sizes_that_cannot_work_are_refused(model_dirs, tmp_path):
    with pytest.raises(ValueError, match="disk KV tier does not fit"):
        disk_tier_blocks(4096.0, None, 2**20, free_bytes=8 * 2**30)
    with pytest.raises(ValueError, match="holds no KV block"):
        disk_tier_blocks(1e-9, None, 2**20, free_bytes=None)
    assert disk_tier_blocks(0.0, None, 2**20, free_bytes=None) == 0
    assert disk_tier_blocks(1.0, None, 2**20, free_bytes=None) == 1024
    with pytest.raises(ValueError, match="below the host tier"):
        EngineConfig(model="m", disk_cache_gib=1.0)
    with pytest.raises(ValueError, match="disk_cache_gib must be >= 0"):
        EngineConfig(model="m", disk_cache_gib=-1.0)
    with pytest.raises(ValueError, match="vLLM"):
        EngineConfig(model="m", backend="vllm", disk_cache_gib=1.0)
    with pytest.raises(ValueError, match="disk_max_pending_writes"):
        EngineConfig(model="m", disk_max_pending_writes=0)
    from pdcluster.cluster.config import ClusterConfig

    cluster = ClusterConfig(model="/models/m", engine={"host_cache_gib": 4, "disk_cache_gib": 8})
    assert cluster.engine_options("decode")["disk_cache_gib"] == 8
    with pytest.raises(ValueError, match="vLLM"):
        ClusterConfig(model="/models/m", engine={"host_cache_gib": 0, "disk_cache_gib": 8,
                                                 "backend": "vllm"})
    with pytest.raises(ValueError, match="disk KV tier does not fit"):
        LLM(model_dirs["llama-gqa"], num_kv_blocks=16, num_host_blocks=4,
            disk_cache_gib=1e7, disk_cache_dir=str(tmp_path))
    assert list(Path(tmp_path).rglob("kv-*.bin")) == []


def test_the_disk_folder_is_a_private_subfolder_and_a_planted_one_is_refused(tmp_path):
    given = tmp_path / "given"
    old_umask = os.umask(0o022)  # a usual umask: folders it makes are 0755
    try:
        disk = DiskKVCache.create(str(given), 0.0, 2, 4096)
    finally:
        os.umask(old_umask)
    try:
        assert disk.path.parent == given / "kv-disk"  # not the folder the user named
        assert stat.S_IMODE(disk.path.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(disk.path.stat().st_mode) == 0o600
    finally:
        disk.close()
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir()
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "kv-disk").symlink_to(elsewhere)
    with pytest.raises(UnsafeDirectory, match="symlink"):
        DiskKVCache.create(str(linked), 0.0, 2, 4096)
    assert list(elsewhere.iterdir()) == []
    shared = tmp_path / "shared"
    (shared / "kv-disk").mkdir(parents=True)
    (shared / "kv-disk").chmod(0o777)
    with pytest.raises(UnsafeDirectory, match="writable by group or others"):
        DiskKVCache.create(str(shared), 0.0, 2, 4096)
    assert list((shared / "kv-disk").iterdir()) == []


def test_the_metadata_service_counts_a_nodes_disk_blocks(model_dirs, make_llm):
    """The engine's events, published to the real metadata service, make its Query say how
    many of a prompt's leading blocks the node holds on disk only (NodeMatch.num_disk_blocks)."""
    from pdcluster.engine.core.request import Request
    from pdcluster.metadata_service.events import encode_events
    from tests.metadata_service.test_service import make_service, register

    llm = make_llm(model_dirs["llama-gqa"], enable_kv_events=True)
    engine = llm.engine
    prefix = random_prompts(1, 72, 72, seed=33)[0]
    llm.generate([prefix + [7]], SamplingParams(max_tokens=1))
    push_to_disk(llm, seed=34)
    chain = Request("q", prefix + [7], SamplingParams(), 8, engine.model_config.eos_token_ids,
                    None, engine.config.hash_config).block_hashes[:9]
    assert all(engine.cached_block_media().get(h) == 4 for h in chain)
    service, _, _ = make_service()
    register(service)
    service.publish("p0", 7, 1, encode_events(engine.take_kv_events()))
    assert service.query_tiers(b"".join(chain)) == [("p0", 9, 0, 9)]
    service.index.check_invariants()
