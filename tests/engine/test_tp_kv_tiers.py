"""The host and disk KV tiers at tensor_parallel_size 2 (CPU, gloo): each rank keeps its slice of
every demoted block in a host tier (and a disk file) of its own, rank 0 keeps the bookkeeping.
Prefixes the device evicted come back from the host, and from the disk, with greedy tokens equal
to TP=1's and transformers', through chunked prefill and preemption, rank 1's bytes of each
block identical after the round trip, every pool leak-free. Every rank registers its host tier
with its transfer engine, so the engine offers peers its host slots too, and a group writes a
host block from each rank's own tier (tests/transfer/test_tp_transfer.py pulls from one).

Kept small: every TP=2 engine starts a second process that imports torch and loads its slice."""

from __future__ import annotations

from concurrent.futures import Future

from pdcluster.core.hashing import hash_block_tokens
from pdcluster.core.kv_ranks import KVRanks, RankEndpoint
from pdcluster.core.kv_region import KVRegion
from pdcluster.engine import LLM, SamplingParams
from tests.helpers import assert_tiers_clean
from tests.models import random_prompts
from tests.transfer.loopback import LoopbackFabric

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
FILL = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def _pair(model: str, **options) -> tuple[LLM, LLM]:
    """A TP=2 engine and a TP=1 engine of the same options."""
    common = dict(device="cpu", dtype="float32", **options)
    return LLM(model, tensor_parallel_size=2, **common), LLM(model, **common)


def _same_tokens(pair: tuple[LLM, LLM], model: str, prompts: list[list[int]], hf_reference,
                 params: SamplingParams = GREEDY) -> list:
    """Both engines run `prompts`; the TP=2 outputs, checked against TP=1's and
    transformers'."""
    tp2, tp1 = pair
    outs = tp2.generate(prompts, params)
    for prompt, out, ref in zip(prompts, outs, tp1.generate(prompts, params), strict=True):
        assert out.token_ids == ref.token_ids == hf_reference(model, prompt, params.max_tokens)
    return outs


def _rank1_bytes(llm: LLM, prompt: list[int], num_blocks: int) -> list[bytes]:
    """Rank 1's bytes of the first `num_blocks` full blocks of `prompt`, on the device."""
    engine = llm.engine
    hashes = hash_block_tokens(prompt, engine.config.block_size)[:num_blocks]
    blocks = [engine.block_pool.get_cached_block(h) for h in hashes]
    assert all(b is not None for b in blocks), "the prefix is not on the device"
    return [engine.peers.block_bytes(b.block_id)[0] for b in blocks]


def _close(*llms: LLM) -> None:
    for llm in llms:
        llm.engine.close()


def test_two_ranks_bring_prefixes_back_from_the_host(model_dirs, hf_reference):
    model = model_dirs["llama-gqa"]
    pair = _pair(model, block_size=4, num_kv_blocks=14, max_num_batched_tokens=16,
                 num_host_blocks=64)
    tp2 = pair[0].engine
    try:
        prefix = random_prompts(1, 24, 24, seed=41)[0]  # 6 blocks
        _same_tokens(pair, model, [prefix + [7]], hf_reference)
        before = _rank1_bytes(pair[0], prefix, 6)
        _same_tokens(pair, model, random_prompts(3, 36, 40, seed=42), hf_reference, FILL)
        assert tp2.stats()["num_demoted_blocks"] >= 6
        loaded = tp2.stats()["num_loaded_blocks"]
        out = _same_tokens(pair, model, [prefix + [9, 10]], hf_reference)[0]
        assert out.num_cached_tokens == 24  # every block of the prefix, from the host
        assert tp2.stats()["num_loaded_blocks"] >= loaded + 6
        assert _rank1_bytes(pair[0], prefix, 6) == before  # rank 1's slices came back too
        _same_tokens(pair, model, random_prompts(6, 6, 20, seed=43), hf_reference,
                     SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        assert tp2.scheduler.num_preemptions > 0
        assert_tiers_clean(tp2.tiers)
        assert tp2.kv_region.num_host_blocks == 64  # host slots offered to peers
    finally:
        _close(*pair)


def test_two_ranks_bring_prefixes_back_from_the_disk(model_dirs, hf_reference, tmp_path):
    model = model_dirs["llama-gqa"]
    options = dict(device="cpu", dtype="float32", block_size=8, num_kv_blocks=16,
                   num_host_blocks=16, num_disk_blocks=64)
    tp2 = LLM(model, tensor_parallel_size=2, disk_cache_dir=str(tmp_path / "tp2"), **options)
    pair = (tp2, LLM(model, disk_cache_dir=str(tmp_path / "tp1"), **options))
    engine = tp2.engine
    try:
        assert len(list((tmp_path / "tp2" / "kv-disk").glob("kv-*.bin"))) == 2  # a file per rank
        prefix = random_prompts(1, 72, 72, seed=44)[0]  # 9 blocks
        _same_tokens(pair, model, [prefix + [7]], hf_reference)
        before = _rank1_bytes(tp2, prefix, 9)
        _same_tokens(pair, model, random_prompts(4, 100, 110, seed=45), hf_reference, FILL)
        assert engine.host_cache.collect(engine.tiers, wait=True)  # every rank's writes
        assert engine.stats()["num_spilled_blocks"] >= 9
        out = _same_tokens(pair, model, [prefix + [9, 10]], hf_reference)[0]
        assert out.num_cached_tokens == 72
        assert engine.stats()["num_disk_loaded_blocks"] >= 9  # the prefix, from the disk
        assert _rank1_bytes(tp2, prefix, 9) == before
        assert engine.host_cache.collect(engine.tiers, wait=True)
        assert_tiers_clean(engine.tiers)
        assert engine.reset_prefix_cache()
    finally:
        _close(*pair)
    assert list((tmp_path / "tp2" / "kv-disk").glob("kv-*.bin")) == []  # each rank deleted its own


class _OneRank(KVRanks):
    """Rank 1 of a group, recording what it is asked to write."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, list[int], list[int], list[int]]] = []

    @property
    def endpoints(self) -> list[RankEndpoint]:
        return [RankEndpoint("rank1", 0x100000, host_addr=0x200000)]

    def write(self, rank: int, session: str, src: list[int], dst: list[int],
              lengths: list[int]) -> Future[None]:
        assert rank == 1
        self.writes.append((session, src, dst, lengths))
        done: Future[None] = Future()
        done.set_result(None)
        return done


def test_a_tp_group_writes_a_host_block_from_each_ranks_own_host_tier():
    """Rank 0's device block 1 and host slot 0 (block id 4) into a TP=1 peer's two blocks:
    each rank sends its one KV head of each, the host slot from its own host tier's address."""
    from pdcluster.transfer.group_writer import Destination, GroupWriter

    region = KVRegion(0x1000, 4 * 64, 64, 4, host_addr=0x9000, num_host_blocks=2,
                      num_kv_heads=2)
    rank1 = _OneRank()
    writer = GroupWriter(LoopbackFabric().transport(), region, rank1, timeout_s=1.0)
    rank0: list[tuple[str, list[int], list[int], list[int]]] = []
    writer.transport.write = lambda *args: rank0.append(args)  # type: ignore[method-assign]
    writer.write([1, 4], [0x50000, 0x50080], Destination("peer", 128, [0], None))
    assert rank0 == [("peer", [0x1040], [0x50000], [64]), ("peer", [0x9000], [0x50080], [64])]
    assert rank1.writes == [("peer", [0x100040], [0x50040], [64]),
                            ("peer", [0x200000], [0x500C0], [64])]
