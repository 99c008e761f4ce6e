"""The routing policy as a pure function: formula, ties, herding, starvation, fallback."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.policy import (
    NodeView,
    NoHealthyNode,
    PolicyConfig,
    choose_prefill,
    load_cost,
    route,
)

CONFIG = PolicyConfig(block_size=16, local_prefill_threshold=64)


def make_nodes(n: int, role: str = "both", **kwargs: object) -> list[NodeView]:
    return [NodeView(f"n{i}", role, **kwargs) for i in range(n)]


def test_longest_prefix_wins_at_equal_load() -> None:
    nodes = [NodeView("a", cached_blocks=2), NodeView("b", cached_blocks=10), NodeView("c")]
    assert choose_prefill(nodes, 320, CONFIG, random.Random(0)).node_id == "b"


def test_load_outweighs_a_small_hit() -> None:
    nodes = [NodeView("a", cached_blocks=2, queued_prefill_tokens=5000), NodeView("b")]
    assert choose_prefill(nodes, 320, CONFIG, random.Random(0)).node_id == "b"


def test_formula_matches_the_documented_weights() -> None:
    config = PolicyConfig(queue_weight=2.0, running_weight=10.0, kv_weight=100.0)
    node = NodeView("a", queued_prefill_tokens=7, num_running=3, kv_usage=0.5)
    assert load_cost(node, config) == 2.0 * 7 + 10.0 * 3 + 100.0 * 0.5
    # a node holding the whole prompt but loaded by exactly the prompt's cost ties an idle,
    # empty one: both cost 320
    nodes = [NodeView("hot", cached_blocks=20, queued_prefill_tokens=160), NodeView("cold")]
    config = PolicyConfig(queue_weight=2.0, running_weight=0.0)
    picks = Counter(choose_prefill(nodes, 320, config, random.Random(s)).node_id
                    for s in range(200))
    assert set(picks) == {"hot", "cold"}


def test_ties_are_broken_at_random_with_the_injected_rng() -> None:
    nodes = make_nodes(4)
    picks = [choose_prefill(nodes, 100, CONFIG, random.Random(s)).node_id for s in range(400)]
    counts = Counter(picks)
    assert set(counts) == {"n0", "n1", "n2", "n3"}
    assert min(counts.values()) > 60
    again = [choose_prefill(nodes, 100, CONFIG, random.Random(s)).node_id for s in range(400)]
    assert again == picks


def simulate(nodes: list[NodeView], prompts: list[tuple[int, int]], config: PolicyConfig,
             seed: int = 0) -> Counter[str]:
    """Place (shared_blocks, prompt_tokens) requests one by one; a placed request adds its
    uncached tokens to the node's queue and the node then holds the shared prefix."""
    rng = random.Random(seed)
    state = {n.node_id: n for n in nodes}
    placed: Counter[str] = Counter()
    for shared_blocks, tokens in prompts:
        chosen = choose_prefill(list(state.values()), tokens, config, rng)
        uncached = tokens - chosen.cached_blocks * config.block_size
        state[chosen.node_id] = NodeView(
            chosen.node_id, chosen.role, max(chosen.cached_blocks, shared_blocks),
            chosen.queued_prefill_tokens + uncached, chosen.num_running + 1)
        placed[chosen.node_id] += 1
    return placed


def test_a_shared_system_prompt_does_not_herd() -> None:
    # only n0 holds a 2,048-token system prompt; every request is that prompt + 64 tokens
    nodes = [NodeView("n0", cached_blocks=128)] + make_nodes(8)[1:]
    placed = simulate(nodes, [(128, 2048 + 64)] * 400, CONFIG)
    assert set(placed) == {f"n{i}" for i in range(8)}
    assert max(placed.values()) < 2 * min(placed.values()), placed


def test_single_turn_traffic_starves_no_node() -> None:
    rng = random.Random(1)
    prompts = [(0, rng.randint(50, 4000)) for _ in range(800)]
    placed = simulate(make_nodes(8), prompts, CONFIG)
    assert set(placed) == {f"n{i}" for i in range(8)}
    assert min(placed.values()) > 50, placed


def test_load_only_fallback_is_least_loaded() -> None:
    nodes = [NodeView("a", queued_prefill_tokens=900), NodeView("b", queued_prefill_tokens=100),
             NodeView("c", num_running=100)]
    assert choose_prefill(nodes, 500, CONFIG, random.Random(0)).node_id == "b"


def test_short_uncached_part_prefills_on_the_decode_node() -> None:
    nodes = [NodeView("p", "prefill", cached_blocks=10), NodeView("d", "decode", cached_blocks=9)]
    decision = route(nodes, 10 * 16 + 5, CONFIG, random.Random(0))
    assert (decision.decode_node, decision.prefill_node) == ("d", None)
    assert decision.reason == "local_prefill"
    assert decision.cached_tokens == 9 * 16


def test_long_uncached_part_goes_to_the_prefill_node_with_the_hit() -> None:
    nodes = [NodeView("p0", "prefill"), NodeView("p1", "prefill", cached_blocks=50),
             NodeView("d", "decode")]
    decision = route(nodes, 1000, CONFIG, random.Random(0))
    assert (decision.decode_node, decision.prefill_node) == ("d", "p1")
    assert decision.cached_tokens == 800
    assert decision.reason == "remote_prefill"


def test_multi_turn_sticks_to_the_decode_node_holding_the_conversation() -> None:
    nodes = [NodeView("p", "prefill"), NodeView("d0", "decode"),
             NodeView("d1", "decode", cached_blocks=60, num_running=2)]
    decision = route(nodes, 60 * 16 + 30, CONFIG, random.Random(0))
    assert decision.decode_node == "d1"
    assert decision.prefill_node is None


def test_threshold_is_configurable() -> None:
    nodes = [NodeView("p", "prefill"), NodeView("d", "decode")]
    assert route(nodes, 100, PolicyConfig(local_prefill_threshold=100),
                 random.Random(0)).prefill_node is None
    assert route(nodes, 100, PolicyConfig(local_prefill_threshold=99),
                 random.Random(0)).prefill_node == "p"


def test_draining_and_missing_roles() -> None:
    with pytest.raises(NoHealthyNode):
        route([NodeView("a", draining=True)], 10, CONFIG, random.Random(0))
    with pytest.raises(NoHealthyNode):
        route([NodeView("p", "prefill")], 10, CONFIG, random.Random(0))
    with pytest.raises(NoHealthyNode):
        route([], 10, CONFIG, random.Random(0))
    nodes = [NodeView("a", draining=True, cached_blocks=99), NodeView("b")]
    assert route(nodes, 1000, CONFIG, random.Random(0)).decode_node == "b"
    # no prefill node besides the decode node: it prefills locally, however long the prompt
    assert route([NodeView("d", "decode")], 10_000, CONFIG,
                 random.Random(0)).prefill_node is None


@pytest.mark.parametrize("field, value", [("block_size", 0), ("queue_weight", -1.0),
                                          ("local_prefill_threshold", -1)])
def test_config_is_validated(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        PolicyConfig(**{field: value})
