"""A node dying under the router, against fake nodes over ZMQ: the death is seen at once
(socket monitor), a request whose decode node is lost moves to another node and goes on
exactly, or ends with a clear error by policy; refusals are never moved; nothing hangs."""

from __future__ import annotations

import http.client
import json
import time

import openai
import pytest

from pdcluster.core.node_wire import GenerateRequest, RequestError, SamplingSpec
from pdcluster.router.routing.migration import continuation
from pdcluster.router.routing.policy import PolicyConfig
from tests.router.conftest import SCRIPT
from tests.router.fake_node import FakeNode

pytestmark = pytest.mark.timeout(60)
PROMPT = "Hello world, this is a test."
MAX_TOKENS = 40


def greedy(sequence: list[int]) -> int:
    """A deterministic 'model': the next token is a function of the whole sequence."""
    return SCRIPT[sum((i + 1) * t for i, t in enumerate(sequence)) // 7 % len(SCRIPT)]


def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url, api_key="none", max_retries=0, timeout=10)


def get(router, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", router.app.port, timeout=5)
    conn.request("GET", path)
    resp = conn.getresponse()
    return resp.status, resp.read().decode()


def metric(router, name: str) -> float:
    _, text = get(router, "/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))


def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def start_stream(router, **kwargs):
    return client(router).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, **kwargs)


def serving(nodes: list[FakeNode]) -> FakeNode:
    (node,) = [n for n in nodes if n.num_active()]
    return node


def reference_text(start_router, make_node) -> str:
    router = start_router([make_node("ref", model=greedy)])
    chunks = list(start_stream(router))
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_a_dead_node_is_seen_at_once_and_its_stream_ends_with_an_error(start_router,
                                                                       make_node) -> None:
    node = make_node("d0", delay_s=0.02)
    router = start_router([node], max_migrations=0)
    stream = iter(start_stream(router))
    next(stream)
    killed = time.monotonic()
    node.close()
    with pytest.raises(openai.APIError, match="node d0 disconnected"):
        for _ in stream:
            pass
    assert time.monotonic() - killed < 1.0
    status, body = get(router, "/health")
    assert status == 503
    assert json.loads(body)["nodes"]["d0"] == {"role": "both", "healthy": False,
                                               "connected": False, "inflight": 0,
                                               "draining": False}
    assert metric(router, 'router_migration_failures_total{reason="max_migrations"}') == 1
    assert metric(router, "router_requests_total") == 1  # counted once, with its error


def test_a_lost_decode_node_hands_the_stream_to_another_exactly(start_router,
                                                                make_node) -> None:
    expected = reference_text(start_router, make_node)
    nodes = [make_node("a", model=greedy, delay_s=0.02), make_node("b", model=greedy,
                                                                     delay_s=0.02)]
    router = start_router(nodes)
    stream = iter(start_stream(router))
    chunks = [next(stream) for _ in range(5)]
    dead = serving(nodes)
    killed = time.monotonic()
    dead.close()
    chunks.append(next(stream))
    assert time.monotonic() - killed < 1.0, "the other node should take over at once"
    chunks += list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    (original,) = dead.requests()
    (moved,) = [n for n in nodes if n is not dead][0].requests()
    num_done = len(moved.prompt_token_ids) - len(original.prompt_token_ids)
    assert moved.prompt_token_ids[:len(original.prompt_token_ids)] == original.prompt_token_ids
    assert 5 <= num_done < MAX_TOKENS and moved.sampling.max_tokens == MAX_TOKENS - num_done
    assert chunks[-1].usage.prompt_tokens == len(original.prompt_token_ids)
    assert metric(router, "router_migrations_total") == 1


def test_a_non_streaming_request_moves_too(start_router, make_node) -> None:
    expected = reference_text(start_router, make_node)
    nodes = [make_node("a", model=greedy, delay_s=0.02), make_node("b", model=greedy,
                                                                     delay_s=0.02)]
    router = start_router(nodes)

    def kill_when_streaming() -> None:
        wait_until(lambda: any(n.num_active() for n in nodes))
        time.sleep(0.1)
        serving(nodes).close()

    import threading

    killer = threading.Thread(target=kill_when_streaming)
    killer.start()
    out = client(router).completions.create(model="tiny", prompt=PROMPT,
                                            max_tokens=MAX_TOKENS, temperature=0)
    killer.join(5)
    assert out.choices[0].text == expected and out.usage.completion_tokens == MAX_TOKENS


def test_with_no_healthy_node_left_the_stream_ends_with_a_clear_error(start_router,
                                                                      make_node) -> None:
    node = make_node("d0", delay_s=0.02)
    router = start_router([node], max_migrations=3)
    stream = iter(start_stream(router))
    next(stream)
    node.close()
    with pytest.raises(openai.APIError, match="no other node is healthy") as raised:
        for _ in stream:
            pass
    assert raised.value.code == "no_healthy_node"
    assert metric(router, 'router_migration_failures_total{reason="no_healthy_node"}') == 1


def test_a_refusal_is_never_moved(start_router, make_node) -> None:
    nodes = [make_node("a", refuse="invalid_request"), make_node("b", refuse="invalid_request")]
    router = start_router(nodes)
    with pytest.raises(openai.BadRequestError):
        client(router).completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
    assert sum(len(n.requests()) for n in nodes) == 1
    assert metric(router, "router_migrations_total") == 0


def test_a_hung_node_is_left_after_missed_polls_and_its_request_moves(start_router,
                                                                      make_node) -> None:
    expected = reference_text(start_router, make_node)
    nodes = [make_node("a", model=greedy, delay_s=0.02), make_node("b", model=greedy,
                                                                     delay_s=0.02)]
    router = start_router(nodes)  # polls every 0.1 s, 0.5 s timeout: dead after ~2 s
    stream = iter(start_stream(router))
    chunks = [next(stream) for _ in range(3)]
    hung = serving(nodes)
    hung.frozen = True  # connected, silent
    chunks += list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    hung.frozen = False  # it wakes up: the router's abort is waiting for it
    wait_until(lambda: hung.aborts() == [hung.requests()[0].request_id])
    assert hung.num_active() == 0


def test_a_lost_prefill_node_is_ignored_while_decode_goes_on(start_router, make_node) -> None:
    prefill = make_node("p", role="prefill", ttft_s=30.0)  # still busy with its one token
    decode = make_node("d", role="decode", delay_s=0.02)
    router = start_router([prefill, decode], policy=PolicyConfig(local_prefill_threshold=4))
    stream = iter(start_stream(router))
    chunks = [next(stream)]
    assert prefill.num_active() == 1
    prefill.close()  # the real decode node would time out on the KV and recompute
    chunks += list(stream)
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert metric(router, "router_migrations_total") == 0


def test_a_prefill_refusal_still_fails_the_request(start_router, make_node) -> None:
    prefill = make_node("p", role="prefill", refuse="invalid_request")
    decode = make_node("d", role="decode", delay_s=0.05)
    router = start_router([prefill, decode], policy=PolicyConfig(local_prefill_threshold=4))
    with pytest.raises(openai.BadRequestError, match="prefill node"):
        client(router).completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS)
    wait_until(lambda: decode.aborts())


def test_a_node_is_healthy_again_only_once_it_reconnects_and_answers(start_router,
                                                                     make_node) -> None:
    node = make_node("d0")
    router = start_router([node])
    link = router.app.dispatcher.nodes["d0"]
    wait_until(lambda: link.healthy)
    node.close()
    wait_until(lambda: link.disconnected and not link.healthy, timeout_s=1.0)

    async def send_now():
        stream = await link.generate(GenerateRequest("r1", [1, 2], SamplingSpec(max_tokens=2)))
        return stream.queue.get_nowait(), stream.lost  # failed before anything was sent

    error, lost = router.call(send_now())
    assert isinstance(error, RequestError) and lost and "disconnected" in error.message
    back = make_node("d0", port=node.port)
    wait_until(lambda: link.healthy, timeout_s=5.0)
    out = client(router).completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
    assert out.usage.completion_tokens == 3 and len(back.requests()) == 1


@pytest.mark.parametrize("generated, expected", [
    ([5, 6], (4, [1, 2, 3, 5, 6])), ([5, 2], (4, [1, 2, 3, 5, 2])),
    ([5, 6, 7, 8, 9, 10], None), ([5, 6, 2], None)])
def test_continuation(generated, expected) -> None:
    request = GenerateRequest("r", [1, 2, 3], SamplingSpec(max_tokens=6, min_tokens=3,
                                                           stop_token_ids=[2]))
    moved = continuation(request, generated, 1)
    if expected is None:
        assert moved is None
        return
    assert (moved.sampling.max_tokens, moved.prompt_token_ids) == expected
    assert moved.sampling.min_tokens == 1 and moved.request_id == "r-m1"  # 3 - 2
