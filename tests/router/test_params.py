"""The parameter policy (router.api.params) and what router.api.protocol makes of each parameter:
every vLLM parameter of the two endpoints is in the table, unknown ones and unsupported
values are 400s naming them, and the applied ones reach the node's `SamplingSpec`."""

from __future__ import annotations

import json

import pytest

from pdcluster.core.sampling import MAX_GUIDED_NESTING, GuidedDecoding
from pdcluster.router.api.params import APPLIED, BOTH, CHAT, COMPLETIONS, DEFAULT_ONLY, PARAMS
from pdcluster.router.api.protocol import parse_chat, parse_completion
from pdcluster.router.api.request_prep import sample_seed
from pdcluster.router.errors import ApiError

# vLLM's CompletionRequest / ChatCompletionRequest fields (entrypoints/openai/protocol.py)
VLLM_COMMON = """model frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed
stop stream stream_options temperature top_p user best_of use_beam_search top_k min_p
repetition_penalty length_penalty stop_token_ids include_stop_str_in_output ignore_eos
min_tokens skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens
allowed_token_ids prompt_logprobs add_special_tokens response_format guided_json guided_regex
guided_choice guided_grammar guided_decoding_backend guided_whitespace_pattern priority
request_id logits_processors return_tokens_as_token_ids cache_salt kv_transfer_params
vllm_xargs echo structured_outputs""".split()  # noqa: SIM905
VLLM_COMPLETIONS = ["prompt", "prompt_embeds", "suffix"]
VLLM_CHAT = """messages top_logprobs max_completion_tokens tools tool_choice reasoning_effort
include_reasoning parallel_tool_calls bad_words add_generation_prompt continue_final_message
documents chat_template chat_template_kwargs mm_processor_kwargs structural_tag""".split()  # noqa: SIM905


def completion(**body):
    return parse_completion({"model": "m", "prompt": "hi", **body})


def chat(**body):
    return parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})


def refused(parse, **body) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse(**body)
    assert err.value.status == 400
    return err.value


def test_every_vllm_parameter_has_a_policy() -> None:
    for name in VLLM_COMMON + VLLM_COMPLETIONS + VLLM_CHAT:
        assert name in PARAMS, name
    for name, param in PARAMS.items():
        assert param.endpoints in (BOTH, COMPLETIONS, CHAT), name
        assert param.policy in (APPLIED, DEFAULT_ONLY) and param.note, name


@pytest.mark.parametrize("name", ["frobnicate", "functions", "store", "top_logprobs"])
def test_unknown_parameters_are_refused_by_name(name) -> None:
    assert refused(completion, **{name: 1}).param == name
    if name != "top_logprobs":  # a chat parameter
        assert refused(chat, **{name: 1}).param == name


def test_default_only_parameters_accept_their_default_and_null() -> None:
    for name, param in PARAMS.items():
        if param.policy != DEFAULT_ONLY or param.endpoints == CHAT:
            continue
        completion(**{name: None})
        if param.default is not None and name != "add_special_tokens":
            completion(**{name: param.default})
    completion(add_special_tokens=True)
    chat(add_special_tokens=False)
    assert refused(chat, add_special_tokens=True).param == "add_special_tokens"


@pytest.mark.parametrize("name, value", [("min_p", 0.1), ("use_beam_search", True),
                                         ("priority", 3), ("suffix", "x"),
                                         ("skip_special_tokens", False),
                                         ("prompt_logprobs", 1), ("logits_processors", ["a"])])
def test_unsupported_values_are_refused_by_name(name, value) -> None:
    err = refused(completion, **{name: value})
    assert (err.param, err.code) == (name, "unsupported_parameter")


def test_sampling_fields_reach_the_spec() -> None:
    req = completion(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.3,
                     logit_bias={"7": 100, "9": -5.5}, min_tokens=2, max_tokens=9,
                     stop_token_ids=[5, 2], seed=3, top_k=-1)
    spec = req.sampling_spec(9, [2])
    assert (spec.presence_penalty, spec.frequency_penalty, spec.repetition_penalty) == (
        0.5, -1.0, 1.3)
    assert spec.logit_bias == {7: 100.0, 9: -5.5}
    assert spec.min_tokens == 2 and spec.seed == 3 and spec.top_k == 0
    assert spec.stop_token_ids == [2, 5]  # EOS first, then the request's, once each
    assert completion(ignore_eos=True, stop_token_ids=[5]).sampling_spec(9, [2]) \
        .stop_token_ids == [5]


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
    ({"n": 2, "best_of": 1}, "best_of"), ({"best_of": 2, "stream": True}, "best_of"),
    ({"echo": True, "logprobs": 1}, "echo"),
    ({"stream": True, "stream_options": {"x": 1}}, "stream_options"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_values_name_their_parameter(body, param) -> None:
    assert refused(completion, **body).param == param


def test_max_completion_tokens_and_n() -> None:
    assert completion(max_completion_tokens=7).max_tokens == 7
    assert completion(max_tokens=7, max_completion_tokens=7).max_tokens == 7
    req = completion(n=3, best_of=5)
    assert (req.n, req.best_of) == (3, 5)
    assert req.sampling_spec(4, []).logprobs == 0  # best_of ranks by logprob


def test_chat_logprobs() -> None:
    assert chat(logprobs=True, top_logprobs=3).sampling.logprobs == 3
    assert chat(logprobs=True).sampling.logprobs == 0
    assert chat().sampling.logprobs is None
    assert refused(chat, top_logprobs=2).param == "top_logprobs"
    assert refused(chat, echo=True).param == "echo"


@pytest.mark.parametrize("body, guided", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, GuidedDecoding("json_object", "")),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     GuidedDecoding("json_schema", '{"type": "object"}')),
    ({"guided_json": '{"type": "integer"}'}, GuidedDecoding("json_schema", '{"type": "integer"}')),
    ({"guided_regex": "[a-z]+"}, GuidedDecoding("regex", "[a-z]+")),
    ({"guided_choice": ["yes", "no"]}, GuidedDecoding("choice", '["yes", "no"]')),
    ({"guided_grammar": "root ::= \"a\""}, GuidedDecoding("grammar", "root ::= \"a\"")),
    ({"structured_outputs": {"regex": "a|b"}}, GuidedDecoding("regex", "a|b")),
    ({"structured_outputs": {"json_object": True}}, GuidedDecoding("json_object", "")),
])
def test_structured_output_spellings(body, guided) -> None:
    assert completion(**body).sampling_spec(4, []).guided == guided


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
])
def test_bad_structured_output_is_refused(body, param) -> None:
    assert refused(completion, **body).param == param


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("body, param", [
    ({"guided_json": _nested(MAX_GUIDED_NESTING)}, "guided_json"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": _nested(400)}}},
     "response_format"),
    ({"guided_regex": "(" * 100 + "a" + ")" * 100}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: " + "(" * 80 + '"a"' + ")" * 80}},
     "structured_outputs.grammar"),
])
def test_a_constraint_nested_too_deep_is_refused_naming_the_limit(body, param) -> None:
    error = refused(completion, **body)
    assert error.status == 400 and error.param == param
    assert f"the limit is {MAX_GUIDED_NESTING}" in error.message


def test_brackets_in_literals_and_escapes_do_not_count() -> None:
    deep = '"' + "(" * 200 + '"'
    assert completion(guided_grammar=f"start: {deep}").sampling_spec(4, []).guided
    assert completion(guided_regex="\\(" * 200).sampling_spec(4, []).guided
    assert completion(guided_json={"enum": ["[" * 200]}).sampling_spec(4, []).guided


def test_sample_seeds_are_derived_and_distinct() -> None:
    seeds = [sample_seed(42, i) for i in range(8)]
    assert seeds[0] == 42 and len(set(seeds)) == 8
    assert seeds == [sample_seed(42, i) for i in range(8)]
    assert all(0 <= s < 1 << 63 for s in seeds[1:])


def test_tool_choice_required_sets_the_guided_schema() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}
    req = chat(tools=[tool], tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(req.sampling.guided.spec)
    assert req.sampling.guided.kind == "json_schema" and schema["maxItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["f"]
    named = chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}})
    assert json.loads(named.sampling.guided.spec) == tool["function"]["parameters"]
    auto = chat(tools=[tool])
    assert auto.tool_choice.mode == "auto" and auto.sampling.guided is None
    assert chat(tools=[tool], tool_choice="none").sampling.guided is None
    assert refused(chat, tools=[tool], tool_choice={"type": "function",
                                                    "function": {"name": "g"}}).param \
        == "tool_choice"
    assert refused(chat, tools=[tool], tool_choice="required",
                   response_format={"type": "json_object"}).param == "tool_choice"
