"""A structured-output grammar never stalls a node's other requests: against a real node
server (the own engine, llguidance), a schema nested deeper than `MAX_GUIDED_NESTING` is
refused naming the limit, and a large schema (~0.3-0.5 s to compile here) compiles off the
serving thread while a plain request sent after it streams to its end; one that does not
compile within the node's deadline is refused, and the node serves on. Before, every grammar
compiled on the node's one thread at admission, and every other request waited for it."""

from __future__ import annotations

import json
import time

import pytest

from pdcluster.core.node_wire import GenerateRequest, RequestError, SamplingSpec
from pdcluster.core.sampling import MAX_GUIDED_NESTING, GuidedDecoding
from pdcluster.engine import LLMEngine
from pdcluster.node.client import BlockingNodeClient, tokens_of
from pdcluster.node.server import NodeServer
from tests.cluster_secret import TEST_CURVE


def nested_schema(depth: int) -> str:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return json.dumps(schema)


def large_schema(tag: str, num_properties: int = 2200) -> GuidedDecoding:
    """A schema just under the router's 64 KiB whose compilation takes a while; `tag` makes
    it new to the compiler's cache."""
    properties = {f"{tag}{i}": {"type": "string"} for i in range(num_properties)}
    return GuidedDecoding("json_schema", json.dumps({"type": "object",
                                                     "properties": properties}))


def spec(guided: GuidedDecoding | None = None, max_tokens: int = 4) -> SamplingSpec:
    return SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, guided=guided)


@pytest.fixture
def served(model_dirs):
    def start(**options):
        engine = LLMEngine.from_model(model_dirs["llama-gqa"], num_kv_blocks=128, block_size=8)
        server = NodeServer(engine, "n0", "both", curve=TEST_CURVE, **options).start()
        client = BlockingNodeClient(server.address, curve=TEST_CURVE)
        started.append((server, client))
        return server, client

    started: list = []
    yield start
    for server, client in started:
        client.close()
        server.stop(drain=False)


def test_a_schema_nested_too_deep_is_refused_naming_the_limit(served):
    _, client = served()
    client.send(GenerateRequest("deep", [1, 2, 3], spec(GuidedDecoding(
        "json_schema", nested_schema(MAX_GUIDED_NESTING)))))
    client.send(GenerateRequest("ok", [1, 2, 3], spec(GuidedDecoding(
        "json_schema", nested_schema(MAX_GUIDED_NESTING // 2 - 2)))))
    got = client.collect({"deep", "ok"})
    (error,) = got["deep"]
    assert isinstance(error, RequestError) and error.code == "invalid_request"
    assert "MAX_GUIDED_NESTING" in error.message and str(MAX_GUIDED_NESTING) in error.message
    assert got["ok"][-1].finished


def test_a_slow_grammar_compiles_off_the_thread_that_serves_the_others(served):
    server, client = served()
    compiler = server.engine.grammars
    started = time.perf_counter()
    compiler.check(large_schema("warm"))  # also builds the tokenizer's view, once
    compile_s = time.perf_counter() - started
    assert compile_s > 0.1, f"the schema compiled in {compile_s:.3f} s: too fast to tell"
    client.send(GenerateRequest("slow", [1, 2, 3], spec(large_schema("k"), max_tokens=2)))
    sent = time.perf_counter()
    client.send(GenerateRequest("plain", [4, 5, 6], spec()))
    finished: dict[str, float] = {}
    tokens: dict[str, list] = {"slow": [], "plain": []}
    while len(finished) < 2:
        msg = client.recv(30)
        tokens[msg.request_id].append(msg)
        if getattr(msg, "finished", False) or isinstance(msg, RequestError):
            finished[msg.request_id] = time.perf_counter() - sent
    assert len(tokens_of(tokens["plain"])) == 4
    # admitted once compiled, and served (`{}` may end it at once: no property is required)
    assert tokens_of(tokens["slow"]) and tokens["slow"][-1].error is None
    assert finished["plain"] < finished["slow"]
    assert finished["plain"] < compile_s / 2, (finished, compile_s)


def test_a_grammar_past_the_deadline_is_refused_and_the_node_serves_on(served):
    server, client = served(prepare_timeout_s=0.02)
    server.engine.grammars.check(large_schema("warm", 10))  # the tokenizer's view, once
    client.send(GenerateRequest("slow", [1, 2, 3], spec(large_schema("late"))))
    client.send(GenerateRequest("plain", [4, 5, 6], spec()))
    got = client.collect({"slow", "plain"})
    (error,) = got["slow"]
    assert isinstance(error, RequestError) and error.code == "invalid_request"
    assert "did not finish within 0.02 s" in error.message
    assert len(tokens_of(got["plain"])) == 4
