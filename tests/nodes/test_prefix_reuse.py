"""Global prefix reuse between real nodes: Mooncake over TCP and ZMQ on 127.0.0.1, driven only
through the node protocol. A node given a `PrefixSource` hint pulls the prompt's cached
prefix from the holder instead of computing it; stale, dead or below-threshold hints make it
compute. Tokens are compared with transformers, the moved blocks are read from the nodes'
transfer stats (what `NodeActor.transfer_stats` exports), and every pool is leak-checked."""

from __future__ import annotations

import time

import pytest

from pdcluster.benchmarks.ports import free_port
from pdcluster.core.node_wire import GenerateRequest, PrefixSource, SamplingSpec, TransferSpec
from pdcluster.decode_node.actor import DecodeNodeActor
from pdcluster.node.client import BlockingNodeClient, tokens_of
from pdcluster.prefill_node.actor import PrefillNodeActor
from tests.cluster_secret import TEST_CURVE
from tests.helpers import assert_pool_clean
from tests.models import random_prompts

BLOCK = 8
KV_TIMEOUT_S = 5.0
GREEDY = SamplingSpec(max_tokens=8, temperature=0.0, ignore_eos=True)
OPTIONS = {"engine_options": {"num_kv_blocks": 128, "block_size": BLOCK},
           "kv_timeout_s": KV_TIMEOUT_S, "shared_keys": TEST_CURVE}


@pytest.fixture(scope="module")
def cluster(model_dirs):
    """Holder H (a decode node: any node can hold), puller P (prefill), decode node D."""
    model = model_dirs["llama-gqa"]
    nodes = {"h": DecodeNodeActor("h0", model, **OPTIONS),
             "p": PrefillNodeActor("p0", model, **OPTIONS),
             "d": DecodeNodeActor("d0", model, **OPTIONS)}
    clients = {name: BlockingNodeClient(node.info()["request_address"], curve=TEST_CURVE)
               for name, node in nodes.items()}
    yield nodes, clients
    for name, node in nodes.items():
        clients[name].close()
        node.runtime.stop(drain=False)


@pytest.fixture
def model(model_dirs):
    return model_dirs["llama-gqa"]


def stats(node) -> dict:
    return node.transfer_stats()


def settle(*nodes, timeout_s: float = 10.0) -> None:
    """Wait until no node has work or held blocks, then leak-check every pool."""
    deadline = time.monotonic() + timeout_s
    for node in nodes:
        while node.pool_state()["num_unfinished"] or node.runtime.engine.has_pinned_blocks():
            assert time.monotonic() < deadline, f"{node.info()['node_id']} did not go idle"
            time.sleep(0.01)
        assert_pool_clean(node.runtime.engine.block_pool)


def generate(client, request_id, prompt, **kw):
    client.send(GenerateRequest(request_id, prompt, kw.pop("sampling", GREEDY), **kw))
    return client.collect({request_id})[request_id]


def shared_prompts(seed: int):
    prefix, tail_a, tail_b = random_prompts(3, 6 * BLOCK, 6 * BLOCK, seed=seed)
    return prefix + tail_a[:20], prefix + tail_b[:20]  # 6 shared blocks, 8 full in all


def test_prefill_node_pulls_the_blocks_it_lacks(cluster, model, hf_reference):
    nodes, clients = cluster
    h, p = nodes["h"], nodes["p"]
    first, second = shared_prompts(seed=80)
    generate(clients["h"], "warm-h", first)
    generate(clients["p"], "warm-p", second[:2 * BLOCK + 3])  # P's own hit: k0 = 2 blocks
    before_h, before_p = stats(h), stats(p)
    got = generate(clients["p"], "pull", second,
                   prefix_source=PrefixSource(h.runtime.kv_address, 6))
    assert tokens_of(got) == hf_reference(model, second, 8)
    assert got[-1].num_cached_tokens == 6 * BLOCK
    after_h, after_p = stats(h), stats(p)
    assert after_p["blocks_pulled"] - before_p["blocks_pulled"] == 4  # blocks 2..5
    assert after_p["pulls_ok"] - before_p["pulls_ok"] == 1
    assert after_h["blocks_served"] - before_h["blocks_served"] == 4
    assert after_h["pull_requests_served"] - before_h["pull_requests_served"] == 1
    settle(h, p)


def test_pull_then_write_to_a_decode_node(cluster, model, hf_reference):
    nodes, clients = cluster
    h, p, d = nodes["h"], nodes["p"], nodes["d"]
    first, second = shared_prompts(seed=81)
    generate(clients["h"], "warm-h2", first)
    before_p, before_d = stats(p), stats(d)
    clients["d"].send(GenerateRequest("d", second, GREEDY, TransferSpec(
        "remote_prefill", "t-81", p.runtime.kv_address)))
    clients["p"].send(GenerateRequest(
        "p", second, SamplingSpec(max_tokens=1, temperature=0.0),
        TransferSpec("remote_decode", "t-81"),
        prefix_source=PrefixSource(h.runtime.kv_address, 6)))
    got_d, got_p = clients["d"].collect({"d"})["d"], clients["p"].collect({"p"})["p"]
    expected = hf_reference(model, second, 8)
    assert tokens_of(got_d) == expected and tokens_of(got_p) == expected[:1]
    assert got_p[-1].num_cached_tokens == 6 * BLOCK
    after_p, after_d = stats(p), stats(d)
    assert after_p["blocks_pulled"] - before_p["blocks_pulled"] == 6
    assert after_p["blocks_sent"] - before_p["blocks_sent"] == 9  # the whole prompt to D
    assert after_d["recvs_ok"] - before_d["recvs_ok"] == 1
    settle(h, p, d)


def test_stale_or_foreign_hint_computes_everything(cluster, model, hf_reference):
    nodes, clients = cluster
    h, p = nodes["h"], nodes["p"]
    first, second = shared_prompts(seed=82)
    generate(clients["h"], "warm-h3", first, cache_salt="tenant-a")
    before = stats(p)
    hint = PrefixSource(h.runtime.kv_address, 6)
    never_held = random_prompts(1, 60, 60, seed=83)[0]
    got_stale = generate(clients["p"], "stale", never_held, prefix_source=hint)
    got_salt = generate(clients["p"], "salt", second, cache_salt="tenant-b", prefix_source=hint)
    assert tokens_of(got_stale) == hf_reference(model, never_held, 8)
    assert tokens_of(got_salt) == hf_reference(model, second, 8)
    assert got_stale[-1].num_cached_tokens == got_salt[-1].num_cached_tokens == 0
    after = stats(p)
    assert after["pulls_ok"] - before["pulls_ok"] == 2
    assert after["blocks_pulled"] == before["blocks_pulled"]
    settle(h, p)


def test_dead_holder_falls_back_to_compute_without_hanging(cluster, model, hf_reference):
    nodes, clients = cluster
    p = nodes["p"]
    dead = f"tcp://127.0.0.1:{free_port()}"  # a port nobody listens on
    prompt = random_prompts(1, 60, 60, seed=84)[0]
    before = stats(p)
    started = time.monotonic()
    got = generate(clients["p"], "dead", prompt, prefix_source=PrefixSource(dead, 6))
    assert time.monotonic() - started < KV_TIMEOUT_S
    assert tokens_of(got) == hf_reference(model, prompt, 8)
    assert stats(p)["pulls_failed"] - before["pulls_failed"] == 1
    settle(p)


def test_hint_below_the_threshold_is_ignored(cluster, model, hf_reference):
    nodes, clients = cluster
    h, p = nodes["h"], nodes["p"]
    first, second = shared_prompts(seed=85)
    generate(clients["h"], "warm-h4", first)
    before_h, before_p = stats(h), stats(p)
    got = generate(clients["p"], "small", second,
                   prefix_source=PrefixSource(h.runtime.kv_address, 1))  # 1 < 2 blocks
    assert tokens_of(got) == hf_reference(model, second, 8)
    assert got[-1].num_cached_tokens == 0
    after_p = stats(p)
    assert after_p["pulls_ok"] + after_p["pulls_failed"] == (before_p["pulls_ok"]
                                                            + before_p["pulls_failed"])
    assert stats(h)["pull_requests_served"] == before_h["pull_requests_served"]
    settle(h, p)
