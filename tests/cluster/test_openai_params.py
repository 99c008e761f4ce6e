"""The OpenAI parameters through the real `openai` client against one real `pdcluster serve` (tiny
random llama, one prefill and one decode node): each test would fail if its parameter were ignored.
The router side (router.api.params, router.api.protocol, router.api.generation) is what these check;
tests marked ENGINE also need the node's sampler to apply the field (penalties, logit_bias, the
guided-decoding mask) and fail until it does."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import jsonschema
import openai
import pytest

from pdcluster.benchmarks.ports import free_port
from tests.serve_process import start_serve, stop_serve, wait_until_answering

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
BLOCK = 16
PROMPT = "The quick brown fox jumps over the lazy dog and"
LONG_PROMPT = " ".join(f"item{i % 23} then" for i in range(60))  # ~180 tokens: remote prefill
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    # an enum: a random model under a grammar mask may never close a free string
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string",
                                           "enum": ["Paris", "Oslo", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def served(model_dirs):
    port = free_port()
    model_dir = model_dirs["llama-gqa"]
    proc, _ = start_serve(["--model", model_dir, "--num-prefill", "1", "--num-decode", "1",
                           "--port", str(port), "--block-size", str(BLOCK),
                           "--kv-cache-gib", "0.05", "--local-prefill-threshold", "64"])
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=120)
        name = Path(model_dir).name
        wait_until_answering(client, name)
        yield client, name, port
    finally:
        stop_serve(proc)


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.decode().splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


# ---- logprobs --------------------------------------------------------------------------

def test_completion_logprobs_shape(served):
    client, name, _ = served
    out = client.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0,
                                    logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 3 <= len(top) <= 4 and top[token] == chosen
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the top token


@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT], ids=["local", "disaggregated"])
def test_completion_logprobs_stream_equals_body(served, prompt):
    client, name, _ = served
    body = client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0,
                                     logprobs=2)
    chunks = list(client.completions.create(model=name, prompt=prompt, max_tokens=6,
                                            temperature=0, logprobs=2, stream=True))
    tokens, tops = [], []
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            tokens += c.choices[0].logprobs.tokens
            tops += c.choices[0].logprobs.top_logprobs
    assert tokens == body.choices[0].logprobs.tokens
    assert [sorted(t) for t in tops] == [sorted(t) for t in body.choices[0].logprobs.top_logprobs]


def test_chat_logprobs_stream_and_not(served):
    client, name, _ = served
    messages = [{"role": "user", "content": "Say something."}]
    body = client.chat.completions.create(model=name, messages=messages, max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = body.choices[0].logprobs.content
    assert len(content) == body.usage.completion_tokens == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    stream = client.chat.completions.create(model=name, messages=messages, max_tokens=5,
                                            temperature=0, logprobs=True, top_logprobs=2,
                                            stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


# ---- n, seed, best_of, echo ------------------------------------------------------------

@pytest.mark.parametrize("seed", [1234, None], ids=["seeded-local", "disaggregated"])
def test_n_prefills_the_prompt_once(served, seed):
    client, name, port = served
    before = {m: metric(port, m) for m in ("router_node_prompt_tokens_total",
                                           "router_node_cached_tokens_total",
                                           "router_prefix_hit_tokens_total")}
    out = client.completions.create(model=name, prompt=LONG_PROMPT, max_tokens=8, n=3,
                                    seed=seed, temperature=1.0,
                                    extra_body={"cache_salt": f"n-once-{seed}"})
    grew = {m: metric(port, m) - v for m, v in before.items()}
    num_prompt = out.usage.prompt_tokens
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 24
    assert grew["router_node_prompt_tokens_total"] == 3 * num_prompt
    assert grew["router_prefix_hit_tokens_total"] == 0  # a fresh salt: nothing cached before
    # samples 1 and 2 find every full block of the prompt in the decode node's cache
    assert grew["router_node_cached_tokens_total"] >= 2 * ((num_prompt - 1) // BLOCK) * BLOCK


def test_n_with_seed_is_reproducible(served):
    client, name, _ = served
    replies = [client.completions.create(model=name, prompt=LONG_PROMPT, max_tokens=8, n=3,
                                         seed=1234, temperature=1.0) for _ in range(2)]
    texts = [[c.text for c in sorted(r.choices, key=lambda c: c.index)] for r in replies]
    assert texts[0] == texts[1] and len(set(texts[0])) == 3


def test_n_streams_interleaved_choices(served):
    client, name, _ = served
    chunks = list(client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, n=2,
        seed=5, temperature=1.0, stream=True))
    texts = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    body = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, n=2, seed=5,
        temperature=1.0)
    assert texts == {c.index: c.message.content for c in body.choices}


def test_best_of_returns_the_most_likely_sample(served):
    client, name, _ = served
    kwargs = dict(model=name, prompt=PROMPT, max_tokens=6, seed=99, temperature=1.0,
                  logprobs=0)
    three = client.completions.create(n=3, **kwargs)
    best = client.completions.create(n=1, extra_body={"best_of": 3}, **kwargs)
    most_likely = max(three.choices, key=lambda c: sum(c.logprobs.token_logprobs))
    assert [c.text for c in best.choices] == [most_likely.text]


def test_echo_prepends_the_prompt(served):
    client, name, _ = served
    out = client.completions.create(model=name, prompt=PROMPT, max_tokens=4, temperature=0,
                                    echo=True)
    plain = client.completions.create(model=name, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].text == PROMPT + plain.choices[0].text
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=name, prompt=PROMPT, max_tokens=4, echo=True,
                                  logprobs=1)
    assert err.value.param == "echo"


# ---- lengths and stops -----------------------------------------------------------------

def test_max_completion_tokens_on_both_endpoints(served):
    client, name, _ = served
    out = client.completions.create(model=name, prompt=PROMPT, temperature=0,
                                    extra_body={"max_completion_tokens": 5, "ignore_eos": True})
    assert out.usage.completion_tokens == 5
    chat = client.chat.completions.create(model=name, max_completion_tokens=3, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}],
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=name, prompt=PROMPT, max_tokens=4,
                                  extra_body={"max_completion_tokens": 5})
    assert err.value.param == "max_completion_tokens"


def test_stop_token_ids_and_min_tokens(served):
    client, name, _ = served
    ids = _ids(client, name, 10)
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    stopped = client.completions.create(model=name, prompt=PROMPT, max_tokens=10,
                                        temperature=0, extra_body={"stop_token_ids": [ids[k]]})
    assert stopped.usage.completion_tokens == k + 1
    assert stopped.choices[0].finish_reason == "stop"
    held = client.completions.create(model=name, prompt=PROMPT, max_tokens=10, temperature=0,
                                     extra_body={"stop_token_ids": [ids[k]],
                                                 "min_tokens": k + 3})
    assert held.usage.completion_tokens >= k + 3


def _ids(client, name, n: int) -> list[int]:
    """Token ids of a greedy completion of PROMPT, via return_tokens_as_token_ids."""
    out = client.completions.create(model=name, prompt=PROMPT, max_tokens=n,
                                    temperature=0, logprobs=0,
                                    extra_body={"return_tokens_as_token_ids": True})
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]


# ---- refusals --------------------------------------------------------------------------

@pytest.mark.parametrize("extra, param", [
    ({"frobnicate": 1}, "frobnicate"),
    ({"min_p": 0.2}, "min_p"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),
])
def test_unknown_or_unsupported_parameter_is_a_400_naming_it(served, extra, param):
    client, name, _ = served
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=name, prompt=PROMPT, max_tokens=2, extra_body=extra)
    assert err.value.param == param


# ---- ENGINE: these need the node's sampler to apply the fields -------------------------

def test_engine_logit_bias_forces_a_token(served):
    client, name, _ = served
    target = _ids(client, name, 1)[0] + 1
    out = client.completions.create(model=name, prompt=PROMPT, max_tokens=5, temperature=0,
                                    logit_bias={str(target): 100}, logprobs=0,
                                    extra_body={"return_tokens_as_token_ids": True})
    assert out.choices[0].logprobs.tokens == [f"token_id:{target}"] * 5


def test_engine_ignore_eos_runs_past_eos(served):
    client, name, _ = served
    eos = {"2": 100}  # the tiny model's EOS id, made certain
    stopped = client.completions.create(model=name, prompt=PROMPT, max_tokens=6,
                                        temperature=0, logit_bias=eos)
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    ignored = client.completions.create(model=name, prompt=PROMPT, max_tokens=6,
                                        temperature=0, logit_bias=eos,
                                        extra_body={"ignore_eos": True})
    assert ignored.usage.completion_tokens == 6
    assert ignored.choices[0].finish_reason == "length"


def test_engine_response_format_json_schema_validates(served):
    client, name, _ = served
    schema = {"type": "object", "properties": {"name": {"enum": ["Ada", "Alan", "Grace"]},
                                               "adult": {"type": "boolean"}},
              "required": ["name", "adult"], "additionalProperties": False}
    out = client.chat.completions.create(
        model=name, max_tokens=100, temperature=0,
        messages=[{"role": "user", "content": "A person as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": schema}})
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


@pytest.mark.parametrize("choice", ["required",
                                    {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_engine_tool_choice_gives_valid_tool_calls(served, choice):
    client, name, _ = served
    out = client.chat.completions.create(
        model=name, max_tokens=100, temperature=0, tools=[WEATHER], tool_choice=choice,
        parallel_tool_calls=False,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments),
                        WEATHER["function"]["parameters"])


def test_engine_tool_call_streams_as_a_delta(served):
    client, name, _ = served
    chunks = list(client.chat.completions.create(
        model=name, max_tokens=100, temperature=0, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, stream=True,
        messages=[{"role": "user", "content": "Weather in Oslo?"}]))
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert len(calls) >= 1 and calls[0].function.name == "get_weather"
    json.loads(calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

