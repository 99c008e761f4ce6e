"""The routing policy as a pure function: formula, ties, herding, starvation, fallback, and the
decayed work count that evens out sticky conversations at low load."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pdcluster.router.errors import NoHealthyNode
from pdcluster.router.routing.load_decay import DecayedWork
from pdcluster.router.routing.policy import (
    NodeView,
    PolicyConfig,
    choose_prefill,
    load_cost,
    request_work,
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
    config = PolicyConfig(queue_weight=2.0, running_weight=10.0, kv_weight=100.0,
                          work_weight=0.5, output_token_weight=4.0)
    node = NodeView("a", queued_prefill_tokens=7, num_running=3, kv_usage=0.5, recent_work=60)
    assert load_cost(node, config) == 2.0 * 7 + 10.0 * 3 + 100.0 * 0.5 + 0.5 * 60
    assert request_work(100, 5, config) == 100 + 4.0 * 5
    # a node holding the whole prompt but loaded by exactly the prompt's cost ties an idle,
    # empty one: both cost 320
    nodes = [NodeView("hot", cached_blocks=20, queued_prefill_tokens=160), NodeView("cold")]
    config = PolicyConfig(block_size=16, queue_weight=2.0, running_weight=0.0)
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


def test_decayed_work_halves_every_half_life() -> None:
    work = DecayedWork(half_life_s=10.0)
    work.add("a", 800.0, now=100.0)
    assert work.value("a", 100.0) == 800.0
    assert work.value("a", 110.0) == pytest.approx(400.0)
    assert work.value("a", 130.0) == pytest.approx(100.0)
    work.add("a", 50.0, now=120.0)  # 200 left of the first, plus the new
    assert work.value("a", 120.0) == pytest.approx(250.0)
    assert work.value("never-seen", 120.0) == 0.0
    assert work.values(130.0) == {"a": pytest.approx(125.0)}


def test_decayed_work_stays_exact_over_a_long_run() -> None:
    work, steady = DecayedWork(half_life_s=1.0), 1 / (1 - 2 ** -0.5)
    for step in range(2000):  # 1,000 half-lives: the epoch moves forward many times
        work.add("a", 1.0, now=step * 0.5)
    # a unit every half half-life converges to 1 / (1 - 2 ** -0.5)
    assert work.value("a", 999.5) == pytest.approx(steady)
    assert work.value("a", 1000.5) == pytest.approx(steady / 2)


def test_a_joining_node_starts_at_the_mean() -> None:
    work = DecayedWork(half_life_s=10.0)
    for node_id in ("a", "b"):
        work.join(node_id, now=0.0)
    work.add("a", 1000.0, now=0.0)
    work.join("c", now=10.0)
    assert work.value("c", 10.0) == pytest.approx(250.0)  # mean of 500 and 0
    work.join("a", now=10.0)  # known: unchanged
    assert work.value("a", 10.0) == pytest.approx(500.0)
    with pytest.raises(ValueError, match="half_life_s"):
        DecayedWork(0.0)


def _pick_over(over: float, cached: int = 100, **overrides) -> str:
    """Which of "hot" (holding `cached` of the prompt's 102 blocks, its recent work `over`
    above the mean of 8 nodes) and 7 cold nodes (equal work, nothing cached) prefills."""
    config = PolicyConfig(block_size=16, global_reuse_min_tokens=0, **overrides)
    cold_work = 1_000_000.0
    hot_work = (1 + over) * 7 * cold_work / (7 - over)  # so that hot / mean - 1 == over
    nodes = [NodeView("hot", cached_blocks=cached, recent_work=hot_work)]
    nodes += [NodeView(f"cold{i}", recent_work=cold_work) for i in range(7)]
    return choose_prefill(nodes, 102 * 16, config, random.Random(0)).node_id


def test_prefix_affinity_is_free_within_the_slack_and_yields_beyond_it() -> None:
    # hot saves 1,600 of 1,632 tokens (98%): inside the slack (5%) no load is charged; past
    # it the charge rises to the whole prompt over the ramp (10%), so hot keeps the request
    # until its excess passes about 5% + 98% x 10%, never at 20%
    assert _pick_over(0.04) == "hot"
    assert _pick_over(0.14) == "hot"
    assert _pick_over(0.16).startswith("cold")
    assert _pick_over(0.20).startswith("cold")
    # a request that would lose little moves as soon as the node is past the slack
    assert _pick_over(0.07, cached=10).startswith("cold")
    assert _pick_over(0.04, cached=10) == "hot"


def test_tilt_steers_only_what_hits_leave_open() -> None:
    # equal hits: the less loaded node wins; one block more: the hit wins, 4% over or not
    assert _pick_over(0.04, cached=0).startswith("cold")
    assert _pick_over(-0.04, cached=0) == "hot"
    assert _pick_over(0.04, cached=1) == "hot"


def test_an_idle_cluster_keeps_a_conversation_where_it_is() -> None:
    # one user alone: hot did all the recent work (a prompt's worth), but the mean counts as
    # at least balance_floor_prompts (8) prompts, so hot's excess is within the ramp; with
    # no floor it is 7 times the mean and the conversation moves
    def pick(**overrides) -> str:
        config = PolicyConfig(block_size=16, global_reuse_min_tokens=0, **overrides)
        nodes = [NodeView("hot", cached_blocks=60, recent_work=64 * 16)]
        nodes += [NodeView(f"cold{i}") for i in range(7)]
        return choose_prefill(nodes, 64 * 16, config, random.Random(0)).node_id

    assert pick() == "hot"
    assert pick(balance_floor_prompts=0.0).startswith("cold")


def conversation_turns(rng: random.Random, num_conversations: int) -> list[tuple[float, int]]:
    """(time, conversation) of every turn: a few long conversations among many short ones."""
    turns = []
    for conv in range(num_conversations):
        at = rng.uniform(0.0, 200.0)
        for _ in range(rng.choice((1, 2, 3, 40))):
            turns.append((at, conv))
            at += rng.uniform(1.0, 5.0)
    return sorted(turns)


def sticky_routing(config: PolicyConfig, seed: int) -> tuple[float, float]:
    """Route conversations over 8 nodes whose queues are always empty (the load report sees
    nothing, as at low utilization); the nodes do not pull prefixes from each other.
    Returns max / mean of the work each node did, and the
    share of follow-up turns that stayed on the node holding their history."""
    rng, work = random.Random(seed), DecayedWork(config.work_half_life_s)
    done = dict.fromkeys((f"n{i}" for i in range(8)), 0.0)
    home: dict[int, tuple[str, int]] = {}  # conversation -> (node holding it, history blocks)
    stayed = follow_ups = 0
    for now, conv in conversation_turns(rng, 200):
        holder, history = home.get(conv, ("", 0))
        prompt = (history + 4) * config.block_size
        nodes = [NodeView(n, cached_blocks=history if n == holder else 0,
                          recent_work=work.value(n, now)) for n in done]
        node = choose_prefill(nodes, prompt, config, rng).node_id
        uncached = prompt - (history * config.block_size if node == holder else 0)
        cost = request_work(uncached, rng.randint(10, 300), config)
        work.add(node, cost, now)
        done[node] += cost
        home[conv] = (node, history + 4)
        follow_ups += bool(holder)
        stayed += node == holder
    return max(done.values()) / (sum(done.values()) / len(done)), stayed / follow_ups


def test_sticky_conversations_even_out_at_low_load() -> None:
    for seed in range(3):
        before, _ = sticky_routing(PolicyConfig(block_size=16, balance_slack=0.0,
                                                balance_tilt=0.0, global_reuse_min_tokens=0),
                                   seed)
        after, stayed = sticky_routing(PolicyConfig(block_size=16, global_reuse_min_tokens=0),
                                       seed)
        assert before > 1.25 and after < 1.15, (before, after)
        assert after - 1 < (before - 1) / 2, (before, after)
        assert stayed > 0.95, "prefix affinity should still keep almost every follow-up"


@pytest.mark.parametrize("field, value", [("block_size", -1), ("queue_weight", -1.0),
                                          ("work_weight", -0.1), ("work_half_life_s", 0.0),
                                          ("balance_slack", -0.1), ("balance_ramp", 0.0),
                                          ("local_prefill_threshold", -1),
                                          ("global_reuse_min_tokens", -1)])
def test_config_is_validated(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        PolicyConfig(**{field: value})


def test_hits_without_a_block_size_are_refused_not_priced() -> None:
    """block_size 0 is unset (the live router binds its cluster's): a node holding blocks
    cannot be priced, and load alone (no holder) needs no block size."""
    nodes = [NodeView("hot", cached_blocks=4), NodeView("cold")]
    with pytest.raises(ValueError, match="block_size is unset"):
        route(nodes, 100, PolicyConfig(), random.Random(0))
    assert route([NodeView("a"), NodeView("b")], 100, PolicyConfig(), random.Random(0))


# --- global prefix reuse ---------------------------------------------------------------------

REUSE = PolicyConfig(block_size=16, local_prefill_threshold=64, global_reuse_min_tokens=128)


def test_a_busy_holder_lends_its_prefix_to_an_idle_prefill_node() -> None:
    # "holder" has 40 of 45 blocks but a long queue; "idle" pulls 40 blocks and computes 5
    nodes = [NodeView("holder", "prefill", cached_blocks=40, queued_prefill_tokens=4000),
             NodeView("idle", "prefill"), NodeView("d", "decode")]
    decision = route(nodes, 45 * 16, REUSE, random.Random(0))
    assert decision.prefill_node == "idle" and decision.decode_node == "d"
    assert (decision.prefix_source, decision.prefix_source_blocks) == ("holder", 40)
    assert decision.cached_tokens == 0  # its own cache: the pulled blocks are not in it yet


def test_a_pull_shorter_than_the_threshold_is_not_worth_it() -> None:
    nodes = [NodeView("holder", "prefill", cached_blocks=7), NodeView("other", "prefill",
             queued_prefill_tokens=10), NodeView("d", "decode")]
    decision = route(nodes, 30 * 16, REUSE, random.Random(0))  # 7 blocks = 112 < 128 tokens
    assert decision.prefix_source is None


def test_the_decode_node_pulls_too_when_it_prefills_locally() -> None:
    # D is cheapest (it holds half the conversation); the rest is on a prefill node
    nodes = [NodeView("p", "prefill", cached_blocks=20, queued_prefill_tokens=9000),
             NodeView("d", "decode", cached_blocks=10)]
    decision = route(nodes, 20 * 16 + 8, REUSE, random.Random(0))
    assert decision.reason == "local_prefill" and decision.decode_node == "d"
    assert (decision.prefix_source, decision.prefix_source_blocks) == ("p", 20)


def test_the_block_of_the_last_prompt_token_is_never_pulled() -> None:
    nodes = [NodeView("holder", "prefill", cached_blocks=32, queued_prefill_tokens=9000),
             NodeView("idle", "prefill"), NodeView("d", "decode")]
    decision = route(nodes, 32 * 16, REUSE, random.Random(0))  # the whole prompt is cached
    assert decision.prefix_source == "holder" and decision.prefix_source_blocks == 31


def test_no_pull_when_disabled_or_when_the_holder_drains() -> None:
    nodes = [NodeView("holder", "prefill", cached_blocks=40, queued_prefill_tokens=4000),
             NodeView("idle", "prefill"), NodeView("d", "decode")]
    off = PolicyConfig(block_size=16, local_prefill_threshold=64, global_reuse_min_tokens=0)
    assert route(nodes, 45 * 16, off, random.Random(0)).prefix_source is None
    nodes[0].draining = True
    assert route(nodes, 45 * 16, REUSE, random.Random(0)).prefix_source is None
