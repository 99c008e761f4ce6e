"""KV tiers in routing: the policy prices a host load from the node's measured costs (device
hit < host load < peer pull < recompute), and the replay's device + host nodes, with the
finite-memory references (round-robin-pool, achievable) in the same run."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdcluster.core.block_index import MEDIUM_BITS, BlockIndex
from pdcluster.core.events import DEVICE, HOST, BlockMoved, BlockStored
from pdcluster.router.routing.policy import NodeView, PolicyConfig, pull_source, route
from pdcluster.router.routing.tier_costs import TierCosts, pull_cost, tier_cost
from pdcluster.router.sim.replay import ReplayConfig, load_trace, replay_all
from pdcluster.router.sim.sim_nodes import SimNode, apply_events
from tests.router.synth_trace import synthetic_trace

CONFIG = PolicyConfig(block_size=16)
# 10k prefill tokens/s, 128 KiB of KV per token, a 40 GB/s host tier, a 25 GB/s pull
COSTS = TierCosts(prefill_tokens_per_s=10_000, kv_bytes_per_token=131_072,
                  host_bytes_per_s=40e9, host_latency_s=2e-4,
                  pull_bytes_per_s=25e9, pull_latency_s=2e-3)


def test_a_host_load_is_priced_from_the_nodes_measurements() -> None:
    node = NodeView("a", cached_blocks=64, host_blocks=64, costs=COSTS)
    tokens = 64 * 16
    expected = (2e-4 + tokens * 131_072 / 40e9) * 10_000
    assert tier_cost(node, CONFIG) == pytest.approx(expected)
    # not measured yet: the config's fallback per token
    assert tier_cost(NodeView("b", cached_blocks=64, host_blocks=64), CONFIG) == \
        pytest.approx(CONFIG.host_weight * tokens)
    assert tier_cost(NodeView("c", cached_blocks=64), CONFIG) == 0.0


def test_device_hit_below_host_load_below_pull_below_recompute() -> None:
    node = NodeView("a", cached_blocks=64, host_blocks=64, costs=COSTS)
    tokens = 64 * 16
    host, pull = tier_cost(node, CONFIG), pull_cost(node, tokens, CONFIG)
    assert 0.0 < host < pull < CONFIG.prefill_weight * tokens


def test_the_policy_prefers_the_device_copy_then_the_host_copy() -> None:
    rng = random.Random(0)
    device = NodeView("dev", cached_blocks=64, costs=COSTS)
    host = NodeView("host", cached_blocks=64, host_blocks=64, costs=COSTS)
    cold = NodeView("cold", costs=COSTS)
    config = PolicyConfig(block_size=16, global_reuse_min_tokens=0)
    assert route([cold, host, device], 64 * 16 + 5, config, rng).decode_node == "dev"
    assert route([cold, host], 64 * 16 + 5, config, rng).decode_node == "host"


def test_a_pull_is_never_sized_by_blocks_a_holder_keeps_only_on_disk() -> None:
    """A peer's pull is served from device and host memory only: a holder whose hit ends in
    disk-only blocks offers the rest, and a holder with the whole prefix in memory wins."""
    config = PolicyConfig(block_size=16, global_reuse_min_tokens=16)
    prompt = 64 * 16 + 5
    spilled = NodeView("spilled", cached_blocks=64, disk_blocks=40, costs=COSTS)
    cold = NodeView("cold", costs=COSTS)
    assert pull_source([spilled, cold], cold, prompt, config) == ("spilled", 24)
    in_memory = NodeView("in-memory", cached_blocks=64, host_blocks=64, costs=COSTS)
    assert pull_source([spilled, in_memory, cold], cold, prompt, config) == ("in-memory", 64)
    on_device = NodeView("on-device", cached_blocks=64, costs=COSTS)
    assert pull_source([in_memory, on_device, cold], cold, prompt, config) == ("on-device", 64)


def test_a_demotion_keeps_the_block_in_the_index() -> None:
    node, index = SimNode("a", capacity=2, host_capacity=4), BlockIndex()
    index.add_node("a")
    x, y, z = b"x" * 32, b"y" * 32, b"z" * 32
    apply_events(index, "a", node.store((x, y)))
    events = node.store((z,))  # the device evicts y: it moves to the host, one event
    assert [type(e) for e in events if not isinstance(e, BlockStored)] == [BlockMoved]
    apply_events(index, "a", events)
    assert index.node_blocks("a") == {x, y, z}
    assert index.query([x, y]) == [("a", 2)]
    assert set(node.host) == {y} and y not in node.cache
    media = index.node_media("a")
    assert media.get(y) == MEDIUM_BITS[HOST] and media.get(x, MEDIUM_BITS[DEVICE]) == 1
    assert index.lower_tiers("a", [x, y]) == (1, 0)  # of the hit, one block to load from host


def test_replay_with_a_host_tier_reuses_more_in_one_run(tmp_path: Path) -> None:
    requests = load_trace(synthetic_trace(tmp_path / "s.jsonl", num_conversations=80, seed=2))
    small = replay_all(requests, "kv", ReplayConfig(num_nodes=4, device_blocks=20))
    tiered = replay_all(requests, "kv", ReplayConfig(num_nodes=4, device_blocks=20,
                                                     host_blocks=200))
    assert tiered["reuse_ratio"] > small["reuse_ratio"]
    assert tiered["host_hit_ratio"] > 0 == small["host_hit_ratio"]
    assert tiered["reuse_ratio"] <= tiered["achievable_hit_ratio"] + 1e-9
    assert tiered["achievable_hit_ratio"] <= tiered["ideal_hit_ratio"] + 1e-9
    pool = tiered["round-robin-pool"]
    assert pool["reuse_ratio"] > tiered["round-robin"]["reuse_ratio"]  # it pulls
    assert tiered["kv"]["ttft_p90_s"] >= tiered["ttft_bound_p90_s"] - 1e-9
