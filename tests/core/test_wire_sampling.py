"""The issue-13 sampling fields on the node wire: every field of `SamplingSpec` (penalties,
logit_bias, guided) and `TokenDelta`'s top-logprob lists survive a round trip, malformed ones
are refused by the codec, and what decodes but is out of range is refused by the node's
`SamplingParams.from_spec` (a `RequestError`, not a dropped frame)."""

from __future__ import annotations

import msgpack
import pytest

from pdcluster.core import node_wire
from pdcluster.core.node_wire import GenerateRequest, SamplingSpec, TokenDelta
from pdcluster.core.sampling import GuidedDecoding
from pdcluster.core.wire import WireError

FULL_SPEC = SamplingSpec(
    max_tokens=9, min_tokens=2, temperature=0.7, top_p=0.9, top_k=5, seed=123,
    stop=["\n"], stop_token_ids=[2, 3], ignore_eos=True, logprobs=3,
    presence_penalty=0.5, frequency_penalty=-1.25, repetition_penalty=1.3,
    logit_bias={7: 100.0, 31999: -100.0, 0: 0.5},
    guided=GuidedDecoding("json_schema", '{"type": "object"}'))


def frame(body: dict) -> bytes:
    return msgpack.packb({"v": node_wire.NODE_WIRE_VERSION, "type": "GenerateRequest",
                          "body": {"request_id": "r", "prompt_token_ids": [1],
                                   "sampling": body}})


@pytest.mark.parametrize("msg", [
    GenerateRequest("r", [1, 2], FULL_SPEC),
    GenerateRequest("r", [1], SamplingSpec(guided=GuidedDecoding("json_object"))),
    TokenDelta("r", [5, 6], True, "stop", [-0.5, -0.25], 3, 0, None,
               [[5, 9], [6, 1]], [[-0.5, -1.5], [-0.25, -2.0]]),
    TokenDelta("r", [5], top_token_ids=[[]], top_logprobs=[[]]),
], ids=["full-spec", "json-object", "top-logprobs", "empty-alternatives"])
def test_round_trip(msg):
    assert node_wire.decode(node_wire.encode(msg)) == msg


def test_the_engine_takes_every_new_field_from_the_spec():
    from pdcluster.engine.core.sampling_params import SamplingParams

    params = SamplingParams.from_spec(node_wire.decode(node_wire.encode(
        GenerateRequest("r", [1], FULL_SPEC))).sampling)
    assert params.logit_bias == FULL_SPEC.logit_bias
    assert params.guided == FULL_SPEC.guided
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.5, -1.25, 1.3)


@pytest.mark.parametrize("body, match", [
    ({"logit_bias": {"7": 1.0}}, "logit_bias key"),
    ({"logit_bias": {True: 1.0}}, "logit_bias key"),
    ({"logit_bias": {7: "high"}}, r"logit_bias\[\]"),
    ({"logit_bias": [[7, 1.0]]}, "must be a map"),
    ({"presence_penalty": "0.5"}, "presence_penalty"),
    ({"repetition_penalty": None}, "repetition_penalty"),
    ({"guided": {"spec": "x"}}, "do not match"),
    ({"guided": {"kind": 3, "spec": ""}}, "guided.kind"),
    ({"guided": "json_object"}, "must be a map"),
    ({"guided": {"kind": "regex", "spec": "a", "extra": 1}}, "do not match"),
])
def test_malformed_fields_are_refused_by_the_codec(body, match):
    with pytest.raises(WireError, match=match):
        node_wire.decode(frame(body))


@pytest.mark.parametrize("body, match", [
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {7: 250.0}}, "logit_bias value"),
    ({"guided": {"kind": "xml", "spec": "<a/>"}}, "guided.kind"),
    ({"guided": {"kind": "choice", "spec": "yes"}}, "not valid JSON"),
])
def test_well_typed_but_out_of_range_fields_are_refused_by_the_node(body, match):
    from pdcluster.engine.core.sampling_params import SamplingParams

    spec = node_wire.decode(frame(body)).sampling
    with pytest.raises(ValueError, match=match):
        SamplingParams.from_spec(spec)
