"""The cache-blind routing baselines (router/routing/baselines.py) and the router's `routing`
switch: round-robin takes nodes in turn whatever they hold; least-loaded is the policy's cost
function without prefix credit, work memory or pulls."""

from __future__ import annotations

import random

import pytest

from pdcluster.router.config import RouterConfig
from pdcluster.router.errors import NoHealthyNode
from pdcluster.router.routing.baselines import RoundRobin, least_loaded_config
from pdcluster.router.routing.policy import NodeView, PolicyConfig, route
from tests.cluster_secret import ROUTER_CREDENTIALS

CONFIG = PolicyConfig(block_size=16, local_prefill_threshold=32)


def views() -> list[NodeView]:
    return [NodeView("p0", "prefill"), NodeView("p1", "prefill"), NodeView("d0", "decode"),
            NodeView("d1", "decode")]


def test_round_robin_takes_each_role_in_turn_ignoring_cache_and_load():
    nodes = views()
    nodes[0].cached_blocks, nodes[1].queued_prefill_tokens = 100, 10_000
    rr = RoundRobin()
    picks = [rr.route(nodes, 200, CONFIG) for _ in range(4)]
    assert [(d.prefill_node, d.decode_node) for d in picks] == [
        ("p0", "d0"), ("p1", "d1"), ("p0", "d0"), ("p1", "d1")]
    assert all(d.reason == "remote_prefill" and d.cached_tokens == 0 for d in picks)


def test_round_robin_prefills_short_prompts_on_the_decode_node_and_skips_draining():
    nodes = views()
    nodes[2].draining = True
    decision = RoundRobin().route(nodes, 32, CONFIG)
    assert (decision.decode_node, decision.prefill_node) == ("d1", None)
    with pytest.raises(NoHealthyNode):
        RoundRobin().route([NodeView("p0", "prefill")], 100, CONFIG)


def test_least_loaded_ignores_the_work_memory_and_never_pulls():
    config = least_loaded_config(PolicyConfig(block_size=16, local_prefill_threshold=0))
    assert config.work_weight == 0 and config.global_reuse_min_tokens == 0
    nodes = views()
    nodes[0].recent_work = 1e9  # the KV policy would avoid p0; least-loaded does not see it
    nodes[1].queued_prefill_tokens = 64
    decision = route(nodes, 200, config, random.Random(0))
    assert decision.prefill_node == "p0" and decision.prefix_source is None


def test_routing_is_validated():
    assert RouterConfig(model_dir="m", **ROUTER_CREDENTIALS).routing == "kv"
    with pytest.raises(ValueError, match="routing"):
        RouterConfig(model_dir="m", **ROUTER_CREDENTIALS, routing="random")
