"""The global pool: a node pulls a prefix that its holder keeps only in its host tier, and the
holder writes it straight from host memory (registered with the transport), without loading
it back to its device. Exact tokens against transformers, over the loopback fake and over real
Mooncake on 127.0.0.1; leak checks on both pools of both nodes."""

from __future__ import annotations

import pytest

from pdcluster.core.hashing import hash_block_tokens
from pdcluster.core.kv_transfer import PrefixPull
from pdcluster.engine import SamplingParams
from tests.helpers import assert_pool_clean, assert_tiers_clean
from tests.models import random_prompts
from tests.transfer.disagg import drive, idle, make_engine
from tests.transfer.loopback import LoopbackFabric

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 8


def run(*engines):
    return drive(list(engines), lambda: all(idle(e) for e in engines))


def demoted_holder(holder, prompt: list[int]) -> list[bytes]:
    """`holder` computes `prompt`, then unrelated prompts push its blocks to the host tier;
    returns the prompt's full-block hashes, now on the host only."""
    holder.add_request("warm", prompt, GREEDY)
    run(holder)
    for i, other in enumerate(random_prompts(3, 60, 60, seed=71)):
        holder.add_request(f"other{i}", other, SamplingParams(max_tokens=1))
        run(holder)
    hashes = hash_block_tokens(prompt, BLOCK)[:6]
    device = holder.block_pool.cached_block_map
    host = set(holder.tiers.host.cached_hashes())
    assert all(h in host and h not in device for h in hashes), "prefix not on the host only"
    return hashes


def pull_from_host(holder, puller, holder_addr: str, model: str, hf_reference) -> None:
    prefix = random_prompts(1, 48, 48, seed=70)[0]
    first, second = prefix + [11, 12, 13], prefix + [21, 22, 23, 24]
    demoted_holder(holder, first)
    num_loaded = holder.tiers.num_loaded
    puller.add_request("p", second, GREEDY, prefix_pull=PrefixPull(holder_addr, 6))
    out = run(holder, puller)["p"]
    assert out.token_ids == hf_reference(model, second, 8)
    assert out.num_cached_tokens == 6 * BLOCK
    assert puller.connector.worker.stats.blocks_pulled == 6
    assert holder.connector.worker.stats.blocks_served == 6
    assert holder.tiers.num_loaded == num_loaded  # read from host memory, not loaded back
    assert_tiers_clean(holder.tiers)
    assert_pool_clean(puller.block_pool)


@pytest.fixture
def model(model_dirs):
    return model_dirs["llama-gqa"]


def test_a_pull_is_served_from_the_holders_host_tier(model, hf_reference):
    fabric = LoopbackFabric()
    h_transport, p_transport = fabric.transport(), fabric.transport()
    holder = make_engine(model, h_transport, num_kv_blocks=16, num_host_blocks=64)
    puller = make_engine(model, p_transport)
    try:
        pull_from_host(holder, puller, h_transport.reply_address, model, hf_reference)
    finally:
        holder.close()
        puller.close()


def test_a_pull_from_the_host_tier_over_mooncake(model, hf_reference):
    from pdcluster.transfer.transport import MooncakeTransport
    from tests.cluster_secret import TEST_CURVE

    holder = make_engine(model, MooncakeTransport(curve=TEST_CURVE), num_kv_blocks=16,
                         num_host_blocks=64)
    puller = make_engine(model, MooncakeTransport(curve=TEST_CURVE))
    try:
        address = holder.connector.worker.transport.reply_address
        pull_from_host(holder, puller, address, model, hf_reference)
    finally:
        holder.close()
        puller.close()


def test_region_names_host_slots_past_the_device_blocks():
    from pdcluster.core.kv_connector import KVRegion

    region = KVRegion(0x1000, 4 * 64, 64, 4, host_addr=0x9000, num_host_blocks=3)
    assert region.block_addr(3) == 0x1000 + 3 * 64
    assert region.block_addr(4) == 0x9000  # host slot 0
    assert region.block_addr(6) == 0x9000 + 2 * 64
    with pytest.raises(ValueError, match="outside"):
        region.block_addr(7)
    assert region.memory_ranges() == [(0x1000, 256), (0x9000, 192)]
    strided = KVRegion(0x1000, 4 * 128, 64, 4, block_stride=128, host_addr=0x9000,
                       num_host_blocks=2)
    assert strided.memory_ranges() == [(0x1000, 3 * 128 + 64), (0x9000, 256)]
    with pytest.raises(ValueError, match="one segment"):
        KVRegion(0x1000, 256, 64, 4, segment_offsets=(0, 4096), num_host_blocks=2,
                 host_addr=0x9000)
