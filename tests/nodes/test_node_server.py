"""The node server over a real ZMQ socket: one engine alone, and a prefill + decode pair
joined by the real KV connector (Mooncake over TCP), driven only through the node protocol."""

from __future__ import annotations

import time

import pytest
import zmq

from pdcluster.core.node_wire import (
    AbortRequest,
    GenerateRequest,
    LoadQuery,
    LoadReport,
    RequestError,
    SamplingSpec,
    TokenDelta,
    TransferSpec,
)
from pdcluster.engine import LLMEngine
from pdcluster.node.client import BlockingNodeClient, tokens_of
from pdcluster.node.server import NodeServer
from tests.cluster_secret import TEST_CURVE
from tests.helpers import assert_pool_clean
from tests.models import random_prompts
from tests.transfer.disagg import make_engine

GREEDY = SamplingSpec(max_tokens=8, temperature=0.0, ignore_eos=True)



def wait_idle(server: NodeServer, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while server.engine.has_unfinished_requests() or server.engine.has_pinned_blocks():
        assert time.monotonic() < deadline, "node did not become idle"
        time.sleep(0.01)


def test_streams_exact_tokens(node, model_dirs, hf_reference):
    server, client = node
    prompts = random_prompts(4, 5, 40, seed=50)
    for i, prompt in enumerate(prompts):
        client.send(GenerateRequest(f"r{i}", prompt, GREEDY))
    got = client.collect({f"r{i}" for i in range(4)})
    for i, prompt in enumerate(prompts):
        assert tokens_of(got[f"r{i}"]) == hf_reference(model_dirs["llama-gqa"], prompt, 8)
        final = got[f"r{i}"][-1]
        assert final.finished and final.finish_reason == "length"
        assert final.num_prompt_tokens == len(prompt)
        assert all(len(m.token_ids) == 1 for m in got[f"r{i}"])  # one token per step
    wait_idle(server)
    assert_pool_clean(server.engine.block_pool)


def test_refusals_and_malformed_input_keep_the_node_serving(node):
    server, client = node
    client.send_raw(b"\x93garbage")
    client.send(GenerateRequest("bad", [1, 999_999], GREEDY))
    client.send(GenerateRequest("long", [5] * 3000, GREEDY))
    client.send(GenerateRequest("ok", [1, 2, 3], GREEDY))
    got = client.collect({"bad", "long", "ok"})
    assert isinstance(got["bad"][0], RequestError) and got["bad"][0].code == "invalid_request"
    assert "vocab" in got["bad"][0].message or "[0, 32000)" in got["bad"][0].message
    assert "maximum model length" in got["long"][0].message
    assert len(tokens_of(got["ok"])) == 8
    assert server.stats.num_malformed == 1 and server.stats.num_refused == 2


def test_abort_frees_the_request(node):
    server, client = node
    client.send(GenerateRequest("a", [7] * 20, SamplingSpec(max_tokens=500, ignore_eos=True)))
    assert isinstance(client.recv(), TokenDelta)
    client.send(AbortRequest("a"))
    wait_idle(server)
    assert server.stats.num_aborted == 1
    assert_pool_clean(server.engine.block_pool)


def test_load_report(node):
    server, client = node
    client.send(LoadQuery())
    report = client.recv()
    assert isinstance(report, LoadReport)
    assert report.node_id == "n0" and report.num_total_blocks == 128
    assert report.num_free_blocks == 128 and report.num_running == 0 and not report.draining


def test_drain_finishes_running_requests_and_refuses_new_ones(model_dirs):
    engine = LLMEngine.from_model(model_dirs["llama-gqa"], num_kv_blocks=64, block_size=8)
    server = NodeServer(engine, "n1", "both", curve=TEST_CURVE).start()
    client = BlockingNodeClient(server.address, curve=TEST_CURVE)
    client.send(GenerateRequest("run", [3] * 10, SamplingSpec(max_tokens=30, ignore_eos=True)))
    first = client.recv()
    assert isinstance(first, TokenDelta)
    server.begin_drain()  # what stop() does first; the loop keeps serving "run"
    client.send(GenerateRequest("late", [3] * 10, GREEDY))
    got = client.collect({"run", "late"})
    assert len(first.token_ids) + len(tokens_of(got["run"])) == 30
    assert got["late"][0].code == "draining"
    assert server.stop(drain=True, timeout_s=10)
    assert_pool_clean(engine.block_pool)
    client.close()


def test_nodes_of_one_pod_take_the_ports_of_its_fixed_range(model_dirs):
    """A range the chart's NetworkPolicy admits the router to: each node binds the first free
    port of [port, port + span); one more node than the span fails to start."""
    from pdcluster.benchmarks.ports import free_port

    engine = LLMEngine.from_model(model_dirs["llama-gqa"], num_kv_blocks=16, block_size=8)
    first = free_port()
    servers = [NodeServer(engine, f"n{i}", "both", port=first, port_span=2,
                          curve=TEST_CURVE).start() for i in range(2)]
    try:
        assert [s.address for s in servers] == [f"tcp://127.0.0.1:{first + i}"
                                                for i in range(2)]
        with pytest.raises(zmq.ZMQError):
            NodeServer(engine, "n2", "both", port=first, port_span=2, curve=TEST_CURVE)
    finally:
        for server in servers:
            server.stop(drain=False, timeout_s=1)


def test_prefill_and_decode_nodes_over_mooncake(model_dirs, hf_reference):
    from pdcluster.transfer.transport import MooncakeTransport

    model = model_dirs["llama-gqa"]
    prefill_engine = make_engine(model, MooncakeTransport(curve=TEST_CURVE))
    decode_engine = make_engine(model, MooncakeTransport(curve=TEST_CURVE))
    prefill = NodeServer(prefill_engine, "p0", "prefill", curve=TEST_CURVE).start()
    decode = NodeServer(decode_engine, "d0", "decode", curve=TEST_CURVE).start()
    kv_addr = prefill_engine.connector.worker.transport.reply_address
    to_p = BlockingNodeClient(prefill.address, curve=TEST_CURVE)
    to_d = BlockingNodeClient(decode.address, curve=TEST_CURVE)
    try:
        prompts = random_prompts(3, 10, 60, seed=51)
        for i, prompt in enumerate(prompts):
            to_d.send(GenerateRequest(f"d{i}", prompt, GREEDY,
                                      TransferSpec("remote_prefill", f"t{i}", kv_addr)))
            to_p.send(GenerateRequest(f"p{i}", prompt, SamplingSpec(max_tokens=1,
                                                                    temperature=0.0),
                                      TransferSpec("remote_decode", f"t{i}")))
        got = to_d.collect({f"d{i}" for i in range(3)})
        first = to_p.collect({f"p{i}" for i in range(3)})
        for i, prompt in enumerate(prompts):
            expected = hf_reference(model, prompt, 8)
            assert tokens_of(got[f"d{i}"]) == expected
            assert tokens_of(first[f"p{i}"]) == expected[:1]
        assert decode_engine.connector.worker.stats.recvs_ok == 3
        wait_idle(prefill)
        wait_idle(decode)
        assert_pool_clean(prefill_engine.block_pool)
        assert_pool_clean(decode_engine.block_pool)
    finally:
        for server in (prefill, decode):
            server.stop(drain=False)
            server.engine.close()
        to_p.close()
        to_d.close()
