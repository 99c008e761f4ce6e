"""n / best_of / echo / logprobs through the router's HTTP API (real `openai` client, fake
nodes over ZMQ): where the samples go, and the exact OpenAI shapes, streaming and not."""

from __future__ import annotations

import time

import openai
import pytest

from pdcluster.router.api.request_prep import sample_seed
from pdcluster.router.api.tokenizer import RouterTokenizer
from pdcluster.router.routing.policy import PolicyConfig
from tests.router.conftest import SCRIPT

LONG = "tell me a story about a dog " * 30  # above the local-prefill threshold below


def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url, api_key="none", max_retries=0, timeout=10)


def test_n_samples_share_the_prompt_on_one_decode_node(start_router, make_node) -> None:
    prefill, decode = make_node("p", role="prefill"), make_node("d", role="decode")
    router = start_router([prefill, decode], policy=PolicyConfig(local_prefill_threshold=16))
    out = client(router).completions.create(model="tiny", prompt=LONG, max_tokens=4, n=3)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 12
    assert len(prefill.requests()) == 1  # the prompt is prefilled once, for sample 0
    first, *others = decode.requests()
    assert first.transfer.kind == "remote_prefill"
    assert len(others) == 2 and all(r.transfer is None and r.prefix_source is None
                                    for r in others)
    assert len({r.request_id for r in decode.requests()}) == 3
    assert all(r.prompt_token_ids == first.prompt_token_ids for r in others)


def test_seeded_samples_get_derived_seeds(start_router, make_node) -> None:
    node = make_node()
    router = start_router([node])
    client(router).completions.create(model="tiny", prompt="hi", max_tokens=2, n=3, seed=7)
    assert [r.sampling.seed for r in node.requests()] == [sample_seed(7, i) for i in range(3)]


def test_best_of_returns_n_choices(start_router, make_node) -> None:
    node = make_node()
    router = start_router([node])
    out = client(router).completions.create(model="tiny", prompt="hi", max_tokens=2, n=2,
                                            best_of=4)
    assert [c.index for c in out.choices] == [0, 1] and len(node.requests()) == 4
    assert all(r.sampling.logprobs == 0 for r in node.requests())  # to rank them
    assert out.choices[0].logprobs is None  # not asked for


def test_streamed_choices_carry_their_index(start_router, make_node, model_dir) -> None:
    router = start_router([make_node(delay_s=0.01)])
    chunks = list(client(router).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2,
        stream=True, stream_options={"include_usage": True}))
    text = RouterTokenizer(model_dir).decode(list(SCRIPT[:4]))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == text
        assert mine[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_echo_prepends_the_prompt(start_router, make_node) -> None:
    router = start_router([make_node()])
    out = client(router).completions.create(model="tiny", prompt="Say:", max_tokens=2,
                                            echo=True)
    assert out.choices[0].text.startswith("Say:")
    chunks = list(client(router).completions.create(model="tiny", prompt="Say:", max_tokens=2,
                                                    echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_shape(start_router, make_node, model_dir, stream) -> None:
    router = start_router([make_node()])
    tok = RouterTokenizer(model_dir)
    out = client(router).completions.create(model="tiny", prompt="hi", max_tokens=3,
                                            logprobs=2, stream=stream)
    parts = [c.choices[0].logprobs for c in out] if stream else [out.choices[0].logprobs]
    tokens = [t for p in parts if p for t in p.tokens]
    tops = [t for p in parts if p for t in p.top_logprobs]
    offsets = [t for p in parts if p for t in p.text_offset]
    assert tokens == [tok.token_text(t) for t in SCRIPT[:3]]
    assert [p for p in parts if p][0].token_logprobs[0] == -0.5
    assert tops[0] == {tok.token_text(SCRIPT[0]): -0.5, tok.token_text(SCRIPT[0] + 1): -1.5}
    assert offsets == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_shape(start_router, make_node, model_dir, stream) -> None:
    router = start_router([make_node()])
    tok = RouterTokenizer(model_dir)
    out = client(router).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        logprobs=True, top_logprobs=2, stream=stream)
    parts = ([c.choices[0].logprobs for c in out if c.choices] if stream
             else [out.choices[0].logprobs])
    content = [e for p in parts if p for e in p.content]
    first = tok.token_text(SCRIPT[0])
    assert [e.token for e in content] == [first, tok.token_text(SCRIPT[1])]
    assert (content[0].logprob, content[0].bytes) == (-0.5, list(first.encode()))
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [
        (first, -0.5), (tok.token_text(SCRIPT[0] + 1), -1.5)]


def test_tokens_as_ids(start_router, make_node) -> None:
    router = start_router([make_node()])
    out = client(router).completions.create(model="tiny", prompt="hi", max_tokens=2,
                                            logprobs=0,
                                            extra_body={"return_tokens_as_token_ids": True})
    assert out.choices[0].logprobs.tokens == [f"token_id:{t}" for t in SCRIPT[:2]]


def test_top_logprobs_and_seeded_sampling_prefill_locally(start_router, make_node) -> None:
    prefill, decode = make_node("p", role="prefill"), make_node("d", role="decode")
    router = start_router([prefill, decode], policy=PolicyConfig(local_prefill_threshold=16))
    client(router).completions.create(model="tiny", prompt=LONG, max_tokens=2, logprobs=2)
    client(router).completions.create(model="tiny", prompt=LONG, max_tokens=2, seed=3)
    client(router).completions.create(model="tiny", prompt=LONG, max_tokens=2, seed=3,
                                      temperature=0)
    assert len(prefill.requests()) == 1  # only the greedy one went disaggregated
    assert [r.transfer is None for r in decode.requests()] == [True, True, False]


def test_a_disconnect_aborts_every_sample(start_router, make_node) -> None:
    node = make_node(delay_s=0.05)
    router = start_router([node])
    stream = client(router).completions.create(model="tiny", prompt="x", max_tokens=200, n=3,
                                               stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 5
    while len(node.aborts()) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(node.aborts()) == sorted(r.request_id for r in node.requests())
    assert node.num_active() == 0


def test_a_stop_string_ends_only_its_choice(start_router, make_node, model_dir) -> None:
    node = make_node(delay_s=0.01)
    router = start_router([node])
    text = RouterTokenizer(model_dir).decode(list(SCRIPT[:6]))
    out = client(router).completions.create(model="tiny", prompt="x", max_tokens=6, n=2,
                                            stop=[text.split()[2]])
    assert all(c.finish_reason == "stop" and len(c.text) < len(text) for c in out.choices)
    # Both samples stopped early, both aborted: an abort goes out as its sample's cleanup,
    # which may finish just after the response does.
    deadline = time.monotonic() + 5
    while len(node.aborts()) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(node.aborts()) == 2
