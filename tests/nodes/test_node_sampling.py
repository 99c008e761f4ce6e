"""The OpenAI sampling fields end to end through a real node server: logprobs with the top-k
(token id, logprob) lists per generated token in every streamed `TokenDelta`, logit_bias,
penalties, structured output, min_tokens / stop_token_ids / ignore_eos and seeds, and
refusals of bad values as `RequestError("invalid_request")` — read by a blocking client and
by the router's own `NodeLink`."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdcluster.core.node_wire import GenerateRequest, RequestError, SamplingSpec, TokenDelta
from pdcluster.core.sampling import GuidedDecoding
from pdcluster.node.client import tokens_of
from tests.cluster_secret import TEST_CURVE
from tests.helpers import assert_pool_clean
from tests.models import random_prompts

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}


def spec(**fields) -> SamplingSpec:
    fields.setdefault("temperature", 0.0)
    fields.setdefault("max_tokens", 6)
    return SamplingSpec(ignore_eos=True, **fields)



def test_every_delta_carries_the_chosen_and_top_k_logprobs(node, model_dirs, hf_reference):
    server, client = node
    prompt = random_prompts(1, 5, 20, seed=60)[0]
    client.send(GenerateRequest("lp", prompt, spec(logprobs=3)))
    deltas = client.collect({"lp"})["lp"]
    assert tokens_of(deltas) == hf_reference(model_dirs["llama-gqa"], prompt, 6)
    for delta in deltas:
        n = len(delta.token_ids)
        assert len(delta.logprobs) == len(delta.top_token_ids) == len(delta.top_logprobs) == n
        for token, logprob, ids, values in zip(delta.token_ids, delta.logprobs,
                                               delta.top_token_ids, delta.top_logprobs,
                                               strict=True):
            assert len(ids) == len(values) == 3 and values == sorted(values, reverse=True)
            assert ids[0] == token and values[0] == pytest.approx(logprob)  # greedy: the top
    assert deltas[-1].finished


def test_bias_penalties_guided_and_stops_take_effect(node, model_dirs, hf_reference):
    server, client = node
    prompts = random_prompts(3, 5, 20, seed=61)
    expected = hf_reference(model_dirs["llama-gqa"], prompts[0], 6)
    requests = {
        "bias": spec(logit_bias={777: 100.0}),
        "pen": spec(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=1.5,
                    logit_bias={expected[0]: 5.0}),
        "json": spec(max_tokens=40, guided=GuidedDecoding("json_schema", json.dumps(SCHEMA))),
        "stop": spec(stop_token_ids=[expected[2]]),
        "min": spec(stop_token_ids=[expected[0]], min_tokens=2),
        "seed1": spec(temperature=1.0, seed=9), "seed2": spec(temperature=1.0, seed=9),
    }
    for rid, sampling in requests.items():
        client.send(GenerateRequest(rid, prompts[0], sampling))
    got = client.collect(set(requests))
    out = {rid: tokens_of(messages) for rid, messages in got.items()}
    assert out["bias"] == [777] * 6
    assert out["pen"][0] == expected[0] and out["pen"].count(expected[0]) == 1
    text = server.engine.tokenizer.decode(out["json"], skip_special_tokens=True)
    assert json.loads(text).keys() == {"ok", "n"} and got["json"][-1].finish_reason == "stop"
    assert out["stop"] == expected[:3] and got["stop"][-1].finish_reason == "stop"
    assert expected[0] not in out["min"][:2]  # banned until min_tokens
    assert out["seed1"] == out["seed2"]
    assert_pool_clean(server.engine.block_pool)


@pytest.mark.parametrize("sampling, match", [
    (spec(guided=GuidedDecoding("regex", "a(b")), "guided (regex)"),
    (spec(guided=GuidedDecoding("choice", "yes")), "not valid JSON"),
    (spec(presence_penalty=5.0), "presence_penalty"),
    (spec(repetition_penalty=0.0), "repetition_penalty"),
    (spec(logit_bias={40_000: 1.0}), "logit_bias"),
], ids=["regex", "choice", "presence", "repetition", "bias-id"])
def test_bad_values_are_refused_as_invalid_requests(node, sampling, match):
    server, client = node
    client.send(GenerateRequest("bad", [1, 2, 3], sampling))
    client.send(GenerateRequest("good", [1, 2, 3], spec()))
    got = client.collect({"bad", "good"})
    (error,) = got["bad"]
    assert isinstance(error, RequestError) and error.code == "invalid_request"
    assert match in error.message
    assert len(tokens_of(got["good"])) == 6


def test_the_routers_node_link_reads_the_top_logprobs(node):
    import zmq.asyncio

    from pdcluster.router.config import NodeSpec
    from pdcluster.router.routing.node_link import NodeLink

    server, _ = node

    async def run() -> list[TokenDelta]:
        context = zmq.asyncio.Context()
        link = NodeLink(NodeSpec("n0", "both", server.address), context, curve=TEST_CURVE)
        try:
            stream = await link.generate(GenerateRequest("link", [1, 5, 9], spec(logprobs=2)))
            return [msg async for msg in stream]
        finally:
            await link.close()
            context.term()

    deltas = asyncio.run(asyncio.wait_for(run(), 60))
    assert sum(len(d.token_ids) for d in deltas) == 6
    assert all(len(ids) == 2 for d in deltas for ids in d.top_token_ids)
    assert all(len(d.top_logprobs) == len(d.token_ids) for d in deltas)
