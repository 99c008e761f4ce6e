"""Cross-tenant poisoning through the index, attacked end to end: a real metadata service with
the cluster's credentials (memory backend), a real router serving HTTP (the real OpenAI client
calls it), nodes that speak the real node protocol (tests/router/fake_node.py), each
registering and publishing its block events with its own node credential.

A member node ("liar", registered with its real bootstrap credential) publishes BlockStored for
a victim tenant's salted prefix it was never sent. The router must not route that tenant's
requests to it nor tell a peer to pull from it (its own counters and the nodes' inboxes show
it); the same node's claim on blocks the router did send it is routed on, pulls included.
With real nodes (engine, node server, event publisher), every block they publish for what the
router sent them is attested, output blocks included, and a follow-up hits."""

from __future__ import annotations

import http.client
import json
import time

import openai
import pytest

from pdcluster.core.events import BlockStored
from pdcluster.core.hashing import DEFAULT_HASH_CONFIG, BlockExtra, hash_block_tokens
from pdcluster.core.kv_identity import KVIdentity
from pdcluster.core.node_wire import GenerateRequest
from pdcluster.engine.config import EngineConfig
from pdcluster.metadata_service.client import MetadataClient, make_node_info
from pdcluster.metadata_service.publisher import NodePublisher
from pdcluster.metadata_service.server import ServerThread
from pdcluster.node.config import NodeConfig
from pdcluster.node.runtime import NodeRuntime
from pdcluster.router.routing.policy import PolicyConfig
from tests.cluster_secret import TEST_CURVE, TEST_SECRET, node_credentials, node_token
from tests.metadata_service.helpers import make_config
from tests.models import random_prompts
from tests.router.fake_node import FakeNode

BLOCK = 16
# every request is disaggregated (threshold 0), and a prefix of 2 blocks is worth a pull
POLICY = PolicyConfig(local_prefill_threshold=0, global_reuse_min_tokens=32)
VICTIM = "victim-tenant"


class Member:
    """A node: its protocol endpoint and its publisher, holding its own credential, registered
    with the KV identity (blocks of BLOCK tokens, the router's tokenizer) the router takes."""

    def __init__(self, server: ServerThread, node_id: str, role: str,
                 identity: KVIdentity) -> None:
        self.node = FakeNode(node_id, [7, 8], role=role)
        self.client = MetadataClient(server.address, token=node_token(node_id))
        self.held: set[bytes] = set()
        self.identity = identity
        self.publisher = NodePublisher(self.client, make_node_info(
            node_id, role, request_address=self.node.address,
            kv_address=self.node.kv_address, identity=identity), lambda: self.held, 30)
        self.publisher.register()

    def claim(self, chain: list[bytes]) -> None:
        self.held.update(chain)
        self.publisher.publish([BlockStored(tuple(chain), None, BLOCK)])

    def close(self) -> None:
        self.publisher.deregister()
        self.client.close()
        self.node.close()


def salted_chain(token_ids: list[int], salt: str | None) -> list[bytes]:
    return hash_block_tokens(token_ids, BLOCK, BlockExtra(cache_salt=salt))


def wait_for(predicate, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def complete(client: openai.OpenAI, prompt: list[int]) -> None:
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                              extra_body={"cache_salt": VICTIM})


def last_request(member: Member) -> GenerateRequest | None:
    requests = member.node.requests()
    return requests[-1] if requests else None


@pytest.fixture
def cluster(start_router, model_dir):
    identity = KVIdentity.of(BLOCK, DEFAULT_HASH_CONFIG, model_dir)
    with ServerThread(make_config(cluster_secret=TEST_SECRET)) as server:
        members = {"p1": Member(server, "p1", "prefill", identity),
                   "d1": Member(server, "d1", "decode", identity)}
        router = start_router(metadata_address=server.address, policy=POLICY, seed=0)
        link = router.app.dispatcher.metadata
        wait_for(lambda: {"p1", "d1"} <= set(router.app.dispatcher.nodes)
                 and link.mirror_in_sync, "the router to find the nodes")
        try:
            yield server, router, members
        finally:
            for member in members.values():
                member.close()


def counter(router, name: str, **labels) -> float:
    value = router.app.metrics.registry.get_sample_value(name, labels or None)
    return value or 0.0


def test_a_members_claim_on_a_prefix_it_was_never_sent_routes_nothing(cluster) -> None:
    server, router, members = cluster
    client = openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0)
    dispatcher = router.app.dispatcher
    first = list(range(1000, 1096))  # the victim's first turn: 6 blocks
    complete(client, first)
    sent = last_request(members["d1"])
    assert sent is not None and last_request(members["p1"]) is not None
    for name in ("p1", "d1"):  # both got the prompt: their claims are attested
        members[name].claim(salted_chain(sent.prompt_token_ids, sent.cache_salt))

    second = first + list(range(2000, 2064))  # the follow-up: 10 blocks
    victim_chain = salted_chain(second, sent.cache_salt)
    members["liar"] = liar = Member(server, "liar", "decode", members["d1"].identity)
    liar.claim(victim_chain)  # all 10 blocks, never sent: the poison
    wait_for(lambda: "liar" in dispatcher.nodes and dispatcher.nodes["liar"].healthy
             and dispatcher.metadata.mirror_node_blocks().get("liar") == 10,
             "the router to see the liar's claim")
    assert counter(router, "router_unattested_claims_total", node="liar") == 10

    pulls = counter(router, "router_prefix_pulls_total")
    complete(client, second)
    assert liar.node.requests() == [], "the victim's request was routed to the liar"
    assert last_request(members["d1"]).prompt_token_ids == second
    p_request = last_request(members["p1"])
    assert p_request.prompt_token_ids == second and p_request.prefix_source is None
    assert counter(router, "router_prefix_pulls_total") == pulls  # nobody pulls from it
    assert counter(router, "router_routing_decisions_total", node="d1", role="decode",
                   reason="remote_prefill") == 2
    health = _health(router)["metadata"]  # an open router: the detailed /health
    assert health["unattested_claims"] == {"liar": 10}
    assert health["attested_node_blocks"]["liar"] == 0
    assert health["attested_node_blocks"]["d1"] == 6

    # control: the liar's claim on blocks the router did send it is routed on
    fresh = next(p for p in (list(range(5000 + 100 * i, 5096 + 100 * i)) for i in range(6))
                 if _lands_on(client, liar, p))
    sent = last_request(liar)
    liar.claim(salted_chain(sent.prompt_token_ids, sent.cache_salt))
    wait_for(lambda: dispatcher.metadata.mirror_node_blocks().get("liar") == 16,
             "the liar's genuine claim")
    complete(client, fresh + list(range(3000, 3064)))
    assert last_request(liar).prompt_token_ids == fresh + list(range(3000, 3064))
    p_request = last_request(members["p1"])  # p1 holds none of it: it pulls from the liar
    assert p_request.prefix_source is not None
    assert p_request.prefix_source.kv_address == liar.node.kv_address
    assert p_request.prefix_source.num_blocks == 6
    assert counter(router, "router_unattested_claims_total", node="liar") == 10


def _health(router) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", router.app.port, timeout=10)
    conn.request("GET", "/health")
    return json.loads(conn.getresponse().read())


def _lands_on(client: openai.OpenAI, member: Member, prompt: list[int]) -> bool:
    """Send a fresh prompt; True if the router made `member` its decode node."""
    before = len(member.node.requests())
    complete(client, prompt)
    return len(member.node.requests()) > before


def test_the_decode_nodes_output_blocks_are_attested(cluster) -> None:
    """The decode node caches the blocks its output completes: its claim on them is the
    router's own doing too (the next turn of a conversation hits them)."""
    _, router, members = cluster
    client = openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0)
    dispatcher = router.app.dispatcher
    prompt = list(range(1000, 1090))  # 5 full blocks and 10 tokens
    client.completions.create(model="tiny", prompt=prompt, max_tokens=10,
                              extra_body={"cache_salt": VICTIM})
    sent = last_request(members["d1"])
    whole = salted_chain(sent.prompt_token_ids + [7, 8] * 5, sent.cache_salt)  # its script
    assert len(whole) == 6
    wait_for(lambda: dispatcher.attestations.attested("d1", whole[5]),
             "the output block's attestation")
    members["d1"].claim(whole)
    wait_for(lambda: dispatcher.metadata.mirror_node_blocks().get("d1") == 6, "d1's claim")
    assert counter(router, "router_unattested_claims_total", node="d1") == 0
    complete(client, prompt + [7, 8] * 5 + list(range(3000, 3040)))
    assert len(members["d1"].node.requests()) == 2
    assert counter(router, "router_unattested_claims_total", node="d1") == 0


def test_real_nodes_publish_only_claims_the_router_attested(start_router, model_dirs) -> None:
    """Real nodes (engine, node server, their own event publishers, their own credentials):
    every block they publish for a request the router sent them — the prompt's and those its
    output completed — is one the router attested (the engine's hashes are the router's), and
    the follow-up is routed to the holder and hits."""
    def start_node(address: str, node_id: str) -> NodeRuntime:
        return NodeRuntime(NodeConfig(
            node_id=node_id, role="decode", metadata_address=address, lease_ttl_s=5,
            engine=EngineConfig(model_dirs["llama-gqa"], num_kv_blocks=128, block_size=8),
            publish_interval_s=0.02, **node_credentials(node_id)),
            shared_keys=TEST_CURVE).start()

    with ServerThread(make_config(cluster_secret=TEST_SECRET)) as server:
        nodes = {name: start_node(server.address, name) for name in ("n0", "n1")}
        try:
            # no balance term: the follow-up goes where its prefix is, nothing else
            policy = PolicyConfig(balance_slack=10.0, balance_tilt=0.0)
            router = start_router(metadata_address=server.address, policy=policy, seed=0,
                                  model_dir=model_dirs["llama-gqa"])
            dispatcher = router.app.dispatcher
            wait_for(lambda: {"n0", "n1"} <= set(dispatcher.nodes)
                     and all(n.healthy for n in dispatcher.nodes.values())
                     and dispatcher.metadata.mirror_in_sync, "the router to find the nodes")
            client = openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0,
                                   timeout=60)
            prompt = random_prompts(1, 44, 44, seed=7)[0]  # 5 blocks and 4 tokens
            client.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                      temperature=0, extra_body={"ignore_eos": True})
            # 44 prompt + 5 generated tokens of KV: 6 full blocks, the last one output's
            wait_for(lambda: 6 in dispatcher.metadata.mirror_node_blocks().values(),
                     "the node's blocks in the router's mirror")
            held = {n: k for n, k in dispatcher.metadata.mirror_node_blocks().items() if k}
            assert len(held) == 1 and list(held.values()) == [6], held
            holder = next(iter(held))
            for name in nodes:
                assert counter(router, "router_unattested_claims_total", node=name) == 0

            def idle() -> bool:  # a load report from after the request (its load is gone)
                link = dispatcher.nodes[holder]
                return (link.num_inflight == 0 and link.report is not None
                        and link.report.num_running == 0 and link.pending_tokens == 0
                        and link.report.queued_prefill_tokens == 0)
            wait_for(idle, "the holder's load report to settle")
            out = client.completions.create(model="tiny", prompt=prompt + [5, 6, 7, 8] * 6,
                                            max_tokens=2, temperature=0)
            assert out.usage.prompt_tokens_details.cached_tokens == 40
            assert counter(router, "router_routing_decisions_total", node=holder,
                           role="decode", reason="local_prefill") == 2
        finally:
            for node in nodes.values():
                node.stop()
