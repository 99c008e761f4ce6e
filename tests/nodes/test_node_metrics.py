"""Node metrics (node/metrics.py): a prefill and a decode node (engine + Mooncake connector
over TCP + node server) serving Prometheus metrics on 127.0.0.1; the figures are read back
over HTTP and move as requests run — prefix hits after a repeated prompt (and none after a
prefix-cache reset), blocks sent and received after a P->D transfer, step times, the
registration in the metadata service."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdcluster.core.node_wire import GenerateRequest, SamplingSpec, TransferSpec
from pdcluster.engine.config import EngineConfig
from pdcluster.metadata_service.client import MetadataClient
from pdcluster.metadata_service.server import ServerThread
from pdcluster.node.client import BlockingNodeClient, tokens_of
from pdcluster.node.config import NodeConfig
from pdcluster.node.metrics import MetricsServer, NodeMetrics
from pdcluster.node.runtime import NodeRuntime
from tests.cluster_secret import TEST_CURVE, TEST_SECRET, node_credentials
from tests.metadata_service.helpers import make_config
from tests.models import random_prompts

OPTIONS = {"num_kv_blocks": 128, "block_size": 8}


def start_node(model: str, node_id: str, role: str, metadata_address: str | None = None):
    return NodeRuntime(NodeConfig(node_id=node_id, role=role,
                                  engine=EngineConfig(model, **OPTIONS), metrics_port=0,
                                  metadata_address=metadata_address, publish_interval_s=0.02,
                                  **node_credentials(node_id)), shared_keys=TEST_CURVE).start()


def scrape(node: NodeRuntime) -> dict[tuple[str, tuple], float]:
    """Every sample of the node's /metrics, keyed by (name, sorted labels without node/role)."""
    with urllib.request.urlopen(node.metrics_address, timeout=5) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels["node"] == node.config.node_id
            assert s.labels["role"] == node.config.role
            extra = tuple(sorted((k, v) for k, v in s.labels.items()
                                 if k not in ("node", "role")))
            samples[(s.name, extra)] = s.value
    return samples


def scrape_settled(node: NodeRuntime) -> dict[tuple[str, tuple], float]:
    """`scrape` once the last step's figures are in: the server sends a step's outputs before
    its `on_step` observes the engine, so a client can see its last token first."""
    deadline = time.monotonic() + 5
    samples = scrape(node)
    while samples[("pdcluster_node_requests_running", ())] and time.monotonic() < deadline:
        time.sleep(0.02)
        samples = scrape(node)
    return samples


def sampling(max_tokens: int) -> SamplingSpec:
    return SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture
def metadata():
    with ServerThread(make_config(cluster_secret=TEST_SECRET)) as server, \
            MetadataClient(server.address, cluster_secret=TEST_SECRET) as client:
        yield server, client


def test_prefix_hit_tokens_move_after_a_repeated_prompt(model_dirs):
    node = start_node(model_dirs["llama-gqa"], "solo", "decode")
    wire = BlockingNodeClient(node.server.address, curve=TEST_CURVE)
    try:
        assert node.metrics_address.startswith("http://127.0.0.1:")
        before = scrape(node)
        assert before[("pdcluster_node_prefix_hit_tokens_total", ())] == 0
        assert before[("pdcluster_node_kv_blocks", (("state", "free"),))] == 128
        prompt = random_prompts(1, 41, 41, seed=7)[0]
        for rid in ("first", "again"):
            wire.send(GenerateRequest(rid, prompt, sampling(3)))
            assert len(tokens_of(wire.collect({rid})[rid])) == 3
        after = scrape_settled(node)
        # 41 tokens = 5 full blocks of 8: the second run finds all 40 of them cached
        assert after[("pdcluster_node_prefix_queried_tokens_total", ())] == 82
        assert after[("pdcluster_node_prefix_hit_tokens_total", ())] == 40
        assert after[("pdcluster_node_kv_blocks", (("state", "cached"),))] >= 5
        assert after[("pdcluster_node_requests_total", (("outcome", "admitted"),))] == 2
        assert after[("pdcluster_node_step_seconds_count", ())] >= 4  # 2 requests x 2+ steps
        assert after[("pdcluster_node_requests_running", ())] == 0
        # a reset empties the prefix cache: the same prompt now hits nothing
        assert node.reset_prefix_cache()
        assert scrape(node)[("pdcluster_node_kv_blocks", (("state", "cached"),))] == 0
        wire.send(GenerateRequest("reset", prompt, sampling(3)))
        wire.collect({"reset"})
        assert scrape(node)[("pdcluster_node_prefix_hit_tokens_total", ())] == 40
    finally:
        wire.close()
        node.stop()
    with pytest.raises(OSError):  # the endpoint closes with the node
        urllib.request.urlopen(node.metrics_address, timeout=2)


def test_blocks_sent_and_received_move_after_a_transfer(model_dirs, metadata):
    server, client = metadata
    model = model_dirs["llama-gqa"]
    prefill = start_node(model, "p0", "prefill", server.address)
    decode = start_node(model, "d0", "decode", server.address)
    to_p = BlockingNodeClient(prefill.server.address, curve=TEST_CURVE)
    to_d = BlockingNodeClient(decode.server.address, curve=TEST_CURVE)
    try:
        registered = {n.node_id: n.metrics_address for n in client.list_nodes()}
        assert registered == {"p0": prefill.metrics_address, "d0": decode.metrics_address}
        prompt = random_prompts(1, 40, 40, seed=61)[0]
        to_d.send(GenerateRequest("d", prompt, sampling(4),
                                  TransferSpec("remote_prefill", "t", prefill.kv_address)))
        to_p.send(GenerateRequest("p", prompt, sampling(1), TransferSpec("remote_decode", "t")))
        assert len(tokens_of(to_d.collect({"d"})["d"])) == 4
        to_p.collect({"p"})
        sent, received = scrape(prefill), scrape(decode)
        blocks = ("pdcluster_node_kv_blocks_total",)
        assert sent[(*blocks, (("direction", "sent"),))] == 5
        assert received[(*blocks, (("direction", "received"),))] == 5
        nbytes = decode.engine.kv_spec.block_nbytes * 5
        assert received[("pdcluster_node_kv_bytes_total", (("direction", "received"),))] \
            == nbytes
        assert sent[("pdcluster_node_kv_transfers_total",
                     (("direction", "sent"), ("outcome", "ok")))] == 1
        assert sent[("pdcluster_node_kv_transfer_seconds_count", (("kind", "send"),))] == 1
        assert received[("pdcluster_node_kv_transfer_seconds_count", (("kind", "recv"),))] == 1
        # the prompt was computed on P (40 tokens queried), not on D (its KV arrived)
        assert sent[("pdcluster_node_prefix_queried_tokens_total", ())] == 40
        assert received[("pdcluster_node_prefix_queried_tokens_total", ())] == 0
    finally:
        to_p.close()
        to_d.close()
        prefill.stop()
        decode.stop()


def test_no_metrics_endpoint_unless_asked(model_dirs):
    node = NodeRuntime(NodeConfig(node_id="quiet", role="decode",
                                  engine=EngineConfig(model_dirs["llama-gqa"], **OPTIONS),
                                  **node_credentials("quiet")), shared_keys=TEST_CURVE).start()
    try:
        assert node.metrics_address == "" and node.info()["metrics_address"] == ""
        assert b"pdcluster_node_requests_waiting" in node.metrics.render()
    finally:
        node.stop()


def test_a_port_in_use_falls_back_to_a_free_one():
    first = MetricsServer(NodeMetrics("a", "decode").registry, "127.0.0.1", 0)
    try:
        second = MetricsServer(NodeMetrics("b", "decode").registry, "127.0.0.1", first.port)
        assert second.port not in (0, first.port)
        with urllib.request.urlopen(second.address, timeout=5) as reply:
            assert b'node="b"' in reply.read()
        second.stop()
    finally:
        first.stop()


def test_metrics_port_is_validated():
    with pytest.raises(ValueError, match="metrics port"):
        NodeConfig(node_id="x", role="prefill", engine=EngineConfig("m"), metrics_port=70000,
                   **node_credentials("x"))


def test_speculative_decoding_acceptance_is_exported(model_dirs):
    """A decode node drafting with the target itself (every draft accepted): the draft and
    accepted token counters move, and agree with the engine's own statistics."""
    model = model_dirs["llama-gqa"]
    engine = EngineConfig(model, speculative=f"draft:{model},k=3", **OPTIONS)
    node = NodeRuntime(NodeConfig(node_id="d-spec", role="decode", engine=engine,
                                  metrics_port=0, **node_credentials("d-spec")),
                       shared_keys=TEST_CURVE).start()
    client = BlockingNodeClient(node.server.address, curve=TEST_CURVE)
    try:
        prompt = random_prompts(1, 12, 12, seed=5)[0]
        client.send(GenerateRequest("r", prompt, sampling(24)))
        assert len(tokens_of(client.collect({"r"})["r"])) == 24
        stats = node.engine.spec_decode_stats()
        assert stats.num_draft_tokens > 0
        samples = scrape_settled(node)  # the last verification's figures included
        assert samples[("pdcluster_node_spec_draft_tokens_total", ())] == stats.num_draft_tokens
        assert samples[("pdcluster_node_spec_accepted_tokens_total", ())] == \
            stats.num_accepted_tokens
    finally:
        client.close()
        node.stop()
