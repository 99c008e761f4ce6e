"""Global prefix reuse on the router side: when the policy names a prefix source, the request
sent to the prefilling node (and only that one) carries the holder's KV address and block
count, against fake nodes over ZMQ."""

from __future__ import annotations

import asyncio

import pytest

from pdcluster.core.hashing import DEFAULT_HASH_CONFIG
from pdcluster.core.kv_identity import KVIdentity
from pdcluster.core.node_wire import PrefixSource
from pdcluster.router.config import NodeSpec, RouterConfig
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.routing.dispatch import Dispatcher, Placement
from pdcluster.router.routing.policy import PolicyConfig
from tests.cluster_secret import ROUTER_CREDENTIALS, TEST_CURVE
from tests.router.test_dispatch import make_request

POLICY = PolicyConfig(local_prefill_threshold=16, global_reuse_min_tokens=128)
# blocks of 16 tokens; no tokenizer: the router's model folder is "unused"
IDENTITY = KVIdentity.of(16, DEFAULT_HASH_CONFIG, "unused")


def run_one(nodes, hits: dict[str, int], busy: str, num_prompt_tokens: int,
            metrics: RouterMetrics | None = None):
    """Decide with `hits`, the node `busy` loaded with a backlog, then run the request."""
    config = RouterConfig(
        model_dir="unused", load_interval_s=60.0, node_timeout_s=1.0, seed=0, policy=POLICY,
        cluster_identity=IDENTITY,
        **ROUTER_CREDENTIALS,
        nodes=tuple(NodeSpec(n.node_id, n.role, n.address, n.kv_address) for n in nodes))

    async def scenario():
        dispatcher = Dispatcher(config, metrics or RouterMetrics(), shared_keys=TEST_CURVE)
        await dispatcher.start()
        try:
            dispatcher.nodes[busy].pending_tokens = 20_000  # sent there since its last report
            decision = dispatcher.decide(hits, num_prompt_tokens)
            request = make_request("r1", num_prompt_tokens, 2)
            async for _ in dispatcher.execute(Placement(decision, False), request):
                pass
            await dispatcher.refresh()
            return decision
        finally:
            await dispatcher.close()

    return asyncio.run(scenario())



def assert_ticketed(source: PrefixSource | None, kv_address: str, num_blocks: int, *,
                    puller: str, holder: str) -> None:
    """The hint names the holder and its blocks, with the router's ticket for that pull."""
    assert source is not None and source.ticket is not None
    assert (source.kv_address, source.num_blocks) == (kv_address, num_blocks)
    ticket = source.ticket
    assert (ticket.puller, ticket.holder, ticket.num_blocks) == (puller, holder, num_blocks)
    assert ticket.router.startswith("router/") and len(ticket.signature) == 64

def test_the_prefill_node_is_told_where_to_pull_the_prefix(make_node) -> None:
    holder, idle = make_node("h", role="prefill"), make_node("p", role="prefill")
    decode = make_node("d", role="decode")
    metrics = RouterMetrics()
    decision = run_one([holder, idle, decode], {"h": 40}, "h", 45 * 16, metrics)
    sample = metrics.registry.get_sample_value
    assert sample("router_prefix_pulls_total") == 1
    # p was charged the 5 blocks it computes; d the 2 tokens it decoded (x output weight 10)
    computed = 45 * 16 - 40 * 16
    assert sample("router_node_recent_work", {"node": "p"}) == pytest.approx(computed, rel=1e-3)
    assert sample("router_node_recent_work", {"node": "d"}) == pytest.approx(20, rel=1e-3)
    assert (decision.prefill_node, decision.decode_node) == ("p", "d")
    (sent_to_p,) = idle.requests()
    (sent_to_d,) = decode.requests()
    assert_ticketed(sent_to_p.prefix_source, holder.kv_address, 40, puller="p", holder="h")
    assert sent_to_d.prefix_source is None  # D receives the whole prompt from P
    assert not holder.requests()  # the holder serves the pull on its KV side channel only


def test_a_decode_node_prefilling_locally_pulls_itself(make_node) -> None:
    holder, decode = make_node("h", role="prefill"), make_node("d", role="decode")
    decision = run_one([holder, decode], {"h": 20, "d": 10}, "h", 20 * 16 + 8)
    assert decision.prefill_node is None and decision.decode_node == "d"
    (sent_to_d,) = decode.requests()
    assert_ticketed(sent_to_d.prefix_source, holder.kv_address, 20, puller="d", holder="h")
    assert sent_to_d.transfer is None


def test_no_hint_without_a_worthwhile_holder(make_node) -> None:
    idle, other = make_node("p", role="prefill"), make_node("q", role="prefill")
    decode = make_node("d", role="decode")
    run_one([idle, other, decode], {"q": 4}, "q", 45 * 16)  # 64 tokens < 128: not worth it
    assert all(r.prefix_source is None for n in (idle, other, decode) for r in n.requests())
