"""The cluster on a real local Ray: 2 prefill + 2 decode node actors, the metadata service
they register with, Mooncake over TCP between them, all on 127.0.0.1. Requests go straight to
the nodes over the node protocol (as the router sends them)."""

from __future__ import annotations

import itertools
import time

import pytest
import ray

from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.ray_cluster import RayCluster
from pdcluster.core.hashing import hash_block_tokens
from pdcluster.core.node_wire import GenerateRequest, PrefixSource, SamplingSpec, TransferSpec
from pdcluster.metadata_service.client import MetadataClient
from pdcluster.node.client import tokens_of
from pdcluster.node.runtime import DIRECTORY_REFRESH_S
from tests.cluster_secret import TEST_SECRET
from tests.identity import registered_signer, router_clients
from tests.models import random_prompts

N_OUT = 6
_ids = itertools.count()


@pytest.fixture(scope="module")
def cluster(model_dirs):
    config = ClusterConfig(model=model_dirs["llama-gqa"], num_prefill=2, num_decode=2,
                           engine={"num_kv_blocks": 256, "block_size": 8}, kv_timeout_s=10,
                           node_cpus=0.5)
    running = RayCluster(config, cluster_secret=TEST_SECRET).start()
    yield running
    running.stop(drain_timeout_s=10)


@pytest.fixture(scope="module")
def nodes(cluster):
    by_role: dict[str, list[dict]] = {"prefill": [], "decode": []}
    for info in sorted(cluster.nodes(), key=lambda n: n["node_id"]):
        by_role[info["role"]].append(info)
    return by_role


def submit(clients, prefill: dict, decode: dict, prompt: list[int],
           prefix_source: PrefixSource | None = None) -> str:
    n = next(_ids)
    rid, tid = f"r{n}", f"t{n}"
    clients[decode["node_id"]].send(GenerateRequest(
        rid, prompt, SamplingSpec(max_tokens=N_OUT, temperature=0.0, ignore_eos=True),
        TransferSpec("remote_prefill", tid, prefill["kv_address"])))
    clients[prefill["node_id"]].send(GenerateRequest(
        f"p{n}", prompt, SamplingSpec(max_tokens=1, temperature=0.0),
        TransferSpec("remote_decode", tid), prefix_source=prefix_source))
    return rid


def wait_restarted(actor, timeout_s: float = 120.0) -> None:
    """Ray refuses calls while it restarts an actor (no task retries): poll until it's back."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.ping.remote(), timeout=30)
            return
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            assert time.monotonic() < deadline, "the actor was not restarted"
            time.sleep(0.5)


@pytest.fixture(scope="module")
def clients(nodes, cluster):
    """A client per node, as a registered router (the nodes admit the keys the metadata
    service vouches for)."""
    made = router_clients(cluster.metadata_address, cluster.cluster_secret,
                          {n["node_id"]: n["request_address"]
                           for role in nodes.values() for n in role})
    yield made
    for client in made.values():
        client.close()


def test_nodes_registered_with_the_metadata_service(cluster, nodes):
    with MetadataClient(cluster.metadata_address, cluster_secret=cluster.cluster_secret) as client:
        registered = {n.node_id for n in client.list_nodes()}
    assert registered == {"p0", "p1", "d0", "d1"}


def test_32_concurrent_requests_match_transformers(nodes, clients, model_dirs, hf_reference):
    prompts = random_prompts(32, 4, 60, seed=70)
    pending = {}
    for i, prompt in enumerate(prompts):
        rid = submit(clients, nodes["prefill"][i % 2], nodes["decode"][i // 2 % 2], prompt)
        pending[rid] = (nodes["decode"][i // 2 % 2]["node_id"], prompt)
    for node_id in ("d0", "d1"):
        mine = {rid for rid, (nid, _) in pending.items() if nid == node_id}
        got = clients[node_id].collect(mine, timeout_s=120)
        for rid in mine:
            expected = hf_reference(model_dirs["llama-gqa"], pending[rid][1], N_OUT)
            assert tokens_of(got[rid]) == expected


def test_second_turn_hits_the_decode_cache_and_moves_fewer_blocks(nodes, clients, cluster,
                                                                  model_dirs, hf_reference):
    p, d = nodes["prefill"][0], nodes["decode"][0]
    actor = cluster.actors["d0"]
    turn1 = random_prompts(1, 48, 48, seed=71)[0]
    rid1 = submit(clients, p, d, turn1)
    answer = tokens_of(clients["d0"].collect({rid1})[rid1])
    before = ray.get(actor.transfer_stats.remote())["blocks_received"]
    turn2 = turn1 + answer + random_prompts(1, 20, 20, seed=72)[0]  # 74 tokens: 10 blocks
    rid = submit(clients, p, d, turn2)
    got = clients["d0"].collect({rid})[rid]
    assert tokens_of(got) == hf_reference(model_dirs["llama-gqa"], turn2, N_OUT)
    assert got[-1].num_cached_tokens == 48  # 53 tokens computed in turn 1: 6 full blocks
    assert ray.get(actor.transfer_stats.remote())["blocks_received"] - before == 10 - 6


def test_a_prefill_node_pulls_a_prefix_another_prefill_node_holds(nodes, clients, cluster,
                                                                  model_dirs, hf_reference):
    (p0, p1), d = nodes["prefill"], nodes["decode"][1]
    shared = random_prompts(1, 64, 64, seed=75)[0]  # 8 blocks of 8 tokens
    clients[d["node_id"]].collect({submit(clients, p0, d, shared)})  # now cached on p0
    before = ray.get(cluster.actors["p1"].transfer_stats.remote())["blocks_pulled"]
    prompt = shared + random_prompts(1, 12, 12, seed=76)[0]
    _, signer = registered_signer(cluster.metadata_address, cluster.cluster_secret)
    # the holder checks the ticket against routers its key directory knows: a router's key
    # reaches it with the directory's periodic refresh (or the router's own handshake)
    time.sleep(1.5 * DIRECTORY_REFRESH_S)
    ticket = signer.sign("pull", p1["node_id"], p0["node_id"], prompt, 8, 8, None)
    rid = submit(clients, p1, d, prompt, PrefixSource(p0["kv_address"], 8, ticket))
    got = clients[d["node_id"]].collect({rid})[rid]
    assert tokens_of(got) == hf_reference(model_dirs["llama-gqa"], prompt, N_OUT)
    assert ray.get(cluster.actors["p1"].transfer_stats.remote())["blocks_pulled"] - before == 8


def test_a_killed_decode_actor_restarts_and_its_old_blocks_leave_the_index(
        nodes, clients, cluster):
    prompt = random_prompts(1, 40, 40, seed=73)[0]
    rid = submit(clients, nodes["prefill"][1], nodes["decode"][1], prompt)
    clients["d1"].collect({rid})
    chain = hash_block_tokens(prompt, 8)
    with MetadataClient(cluster.metadata_address, cluster_secret=cluster.cluster_secret) as client:
        deadline = time.monotonic() + 10
        while dict(client.query(chain)).get("d1") != 5:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        old = {n.node_id: n.epoch for n in client.list_nodes()}["d1"]
        ray.kill(cluster.actors["d1"], no_restart=False)
        wait_restarted(cluster.actors["d1"])
        deadline = time.monotonic() + 30
        while {n.node_id: n.epoch for n in client.list_nodes()}.get("d1") in (None, old):
            assert time.monotonic() < deadline, "the restarted node did not register"
            time.sleep(0.1)
        assert "d1" not in dict(client.query(chain))


def test_a_killed_prefill_actor_makes_decode_recompute(nodes, clients, cluster, model_dirs,
                                                       hf_reference):
    prompt = random_prompts(1, 30, 30, seed=74)[0]
    dead = nodes["prefill"][1]
    ray.kill(cluster.actors["p1"], no_restart=False)  # its KV address goes dead with it
    rid = submit(clients, dead, nodes["decode"][0], prompt)  # P's copy goes nowhere
    got = clients["d0"].collect({rid}, timeout_s=60)[rid]
    assert tokens_of(got) == hf_reference(model_dirs["llama-gqa"], prompt, N_OUT)
    wait_restarted(cluster.actors["p1"])


def test_survivors_pass_the_leak_check(cluster):
    for node_id in ("p0", "d0"):
        deadline = time.monotonic() + 30
        while True:
            state = ray.get(cluster.actors[node_id].pool_state.remote())
            if not state["num_unfinished"] and not state["num_pinned_requests"]:
                break
            assert time.monotonic() < deadline, f"{node_id} did not become idle: {state}"
            time.sleep(0.1)
        assert state["num_held_blocks"] == 0 and state["num_free_blocks"] == state["num_blocks"]
