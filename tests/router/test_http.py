"""The router's HTTP API through the real `openai` client, against fake nodes over ZMQ."""

from __future__ import annotations

import http.client
import json
import sys
import time

import openai
import pytest

from pdcluster.core.node_wire import GenerateRequest
from pdcluster.router.routing.policy import PolicyConfig

TEXT = "Hello world, this is a test."


def client(router, api_key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url, api_key=api_key, max_retries=0, timeout=10)


def raw_post(router, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict,
                                                                                   dict]:
    conn = http.client.HTTPConnection("127.0.0.1", router.app.port, timeout=10)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json",
                                                   **(headers or {})})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), json.loads(data) if data else {}


def test_completion_non_streaming(start_router, make_node) -> None:
    node = make_node()
    router = start_router([node])
    out = client(router).completions.create(model="tiny", prompt="Say hi", max_tokens=8,
                                            temperature=0, seed=3, top_p=0.9, user="u1")
    assert out.choices[0].text.strip() == TEXT
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8
    sent = node.requests()[0]
    assert sent.sampling.max_tokens == 8 and sent.sampling.seed == 3
    assert sent.sampling.top_p == 0.9 and sent.transfer is None
    assert out.usage.prompt_tokens == len(sent.prompt_token_ids)


def test_chat_streaming_with_usage(start_router, make_node) -> None:
    router = start_router([make_node()])
    stream = client(router).chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "be brief"},
                                {"role": "user", "content": "hi"}],
        max_completion_tokens=8, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() == TEXT
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_uses_the_models_template(start_router, make_node) -> None:
    node = make_node()
    router = start_router([node])
    client(router).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    from transformers import AutoTokenizer  # the reference; only the test imports it

    reference = AutoTokenizer.from_pretrained(router.app.config.model_dir)
    expected = reference.apply_chat_template([{"role": "user", "content": "hi"}],
                                             tokenize=True, add_generation_prompt=True)
    expected = list(expected["input_ids"]) if "input_ids" in expected else list(expected)
    assert node.requests()[0].prompt_token_ids == expected


def test_stop_string_cuts_the_text_and_aborts(start_router, make_node) -> None:
    node = make_node(delay_s=0.01)
    router = start_router([node])
    out = client(router).completions.create(model="tiny", prompt="x", max_tokens=40,
                                            stop=[" is"])
    assert out.choices[0].text.strip() == "Hello world, this"
    assert out.choices[0].finish_reason == "stop"
    _wait(lambda: node.aborts() == [node.requests()[0].request_id])
    stream = client(router).completions.create(model="tiny", prompt="x", max_tokens=40,
                                               stop="test", stream=True)
    assert "".join(c.choices[0].text for c in stream).strip() == "Hello world, this is a"


def test_models_health_metrics(start_router, make_node) -> None:
    router = start_router([make_node()])
    assert [m.id for m in client(router).models.list()] == ["tiny"]
    client(router).completions.create(model="tiny", prompt="x", max_tokens=2)
    conn = http.client.HTTPConnection("127.0.0.1", router.app.port, timeout=5)
    conn.request("GET", "/health")
    health = json.loads(conn.getresponse().read())
    assert health["status"] == "ok" and health["routing"] == "load_only"
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    assert 'router_requests_total{endpoint="completions",status="200"} 1.0' in text
    assert 'router_routing_decisions_total{node="n0",reason="load_only",role="decode"}' in text
    assert "router_ttft_seconds_bucket" in text


def test_the_api_also_listens_where_asked(start_router, make_node) -> None:
    """`also_listen`: the same API on more addresses and the same port (in a pod: the pod's IP
    and 127.0.0.1, which `kubectl port-forward` dials). 127.0.0.2 is loopback too on Linux."""
    router = start_router([make_node()], host="127.0.0.1", also_listen=("127.0.0.2",))
    for address in ("127.0.0.1", "127.0.0.2"):
        conn = http.client.HTTPConnection(address, router.app.port, timeout=5)
        conn.request("GET", "/health")
        assert json.loads(conn.getresponse().read())["status"] == "ok", address
        conn.close()
    with pytest.raises(ConnectionRefusedError):  # and nowhere else
        http.client.HTTPConnection("127.0.0.3", router.app.port, timeout=5).request("GET", "/")


@pytest.mark.parametrize("also_listen", [("127.0.0.1",), ("",), ("::1", "::1")])
def test_also_listen_refuses_the_host_blanks_and_repeats(model_dir, also_listen) -> None:
    from pdcluster.router.config import RouterConfig
    from tests.cluster_secret import ROUTER_CREDENTIALS

    with pytest.raises(ValueError, match="also_listen"):
        RouterConfig(model_dir=str(model_dir), host="127.0.0.1", also_listen=also_listen,
                     **ROUTER_CREDENTIALS)


@pytest.mark.parametrize("body, status, code", [
    (b"{not json", 400, "invalid_json"),
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, "invalid_encoding"),
    (b'[1, 2]', 400, "invalid_body"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": "5"}', 400, "invalid_type"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": true}', 400, "invalid_type"),
    (b'{"model": "tiny", "prompt": 5}', 400, "invalid_value"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 0}', 400, "invalid_value"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": -3}', 400, "invalid_value"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 100000}', 400, "context_length_exceeded"),
    (b'{"model": "tiny", "prompt": "x", "temperature": 9}', 400, "invalid_value"),
    (b'{"model": "tiny", "prompt": "x", "n": 17}', 400, "invalid_value"),
    (b'{"model": "tiny", "prompt": "x", "min_p": 0.5}', 400, "unsupported_parameter"),
    (b'{"model": "tiny", "prompt": "x", "frobnicate": 1}', 400, "unknown_parameter"),
    (b'{"model": "nope", "prompt": "x"}', 404, "model_not_found"),
    (b'{"prompt": "x"}', 400, "missing_required_parameter"),
])
def test_bad_requests_are_openai_errors(start_router, make_node, body, status, code) -> None:
    router = start_router([make_node()])
    got, _, payload = raw_post(router, "/v1/completions", body)
    assert (got, payload["error"]["code"]) == (status, code), payload
    assert set(payload["error"]) == {"message", "type", "param", "code"}


def test_prompt_longer_than_context(start_router, make_node) -> None:
    router = start_router([make_node()])
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client(router).completions.create(model="tiny", prompt="word " * 400, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client(router).chat.completions.create(model="tiny", messages=[{"role": "user"}])


def test_oversize_body_is_413(start_router, make_node) -> None:
    router = start_router([make_node()], max_body_bytes=2048)
    body = json.dumps({"model": "tiny", "prompt": "x" * 5000}).encode()
    status, _, payload = raw_post(router, "/v1/completions", body)
    assert status == 413 and payload["error"]["code"] == "request_too_large"


def test_no_healthy_node_is_503_with_retry_after(start_router, make_node) -> None:
    router = start_router([])
    status, headers, payload = raw_post(router, "/v1/completions",
                                        b'{"model": "tiny", "prompt": "x"}')
    assert status == 503 and headers["Retry-After"] == "1"
    assert payload["error"]["code"] == "no_healthy_node"
    silent = make_node("silent")
    silent.answer_load = False
    router = start_router([silent])
    with pytest.raises(openai.InternalServerError):
        client(router).completions.create(model="tiny", prompt="x", max_tokens=2)


def test_node_refusal_maps_to_a_status(start_router, make_node) -> None:
    router = start_router([make_node(refuse="overloaded")])
    status, headers, payload = raw_post(router, "/v1/completions",
                                        b'{"model": "tiny", "prompt": "x", "stream": true}')
    assert status == 503 and payload["error"]["code"] == "overloaded"


def test_api_keys(start_router, make_node) -> None:
    router = start_router([make_node()], api_keys=("sekrit",))
    with pytest.raises(openai.AuthenticationError):
        client(router, "wrong").completions.create(model="tiny", prompt="x", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        client(router, "wrong").models.list()
    out = client(router, "sekrit").completions.create(model="tiny", prompt="x", max_tokens=2)
    assert out.usage.completion_tokens == 2


def test_client_disconnect_aborts_on_the_node(start_router, make_node) -> None:
    node = make_node(delay_s=0.05)
    router = start_router([node])
    stream = client(router).completions.create(model="tiny", prompt="x", max_tokens=200,
                                               stream=True)
    next(iter(stream))
    stream.close()
    _wait(lambda: len(node.aborts()) == 1)
    node2 = make_node("n2", delay_s=0.05)
    router2 = start_router([node2])
    with pytest.raises(openai.APITimeoutError):
        openai.OpenAI(base_url=router2.base_url, api_key="x", max_retries=0,
                      timeout=0.3).completions.create(model="tiny", prompt="x", max_tokens=200)
    _wait(lambda: len(node2.aborts()) == 1)


def test_disaggregated_request_goes_to_both_nodes(start_router, make_node) -> None:
    prefill = make_node("p", role="prefill")
    decode = make_node("d", role="decode")
    router = start_router([prefill, decode], policy=PolicyConfig(local_prefill_threshold=16))
    long_prompt = "tell me a story about a dog " * 30  # > the local-prefill threshold
    out = client(router).completions.create(model="tiny", prompt=long_prompt, max_tokens=8)
    assert out.choices[0].text.strip() == TEXT
    (p_req,), (d_req,) = prefill.requests(), decode.requests()
    assert isinstance(p_req, GenerateRequest)
    assert p_req.transfer.kind == "remote_decode" and p_req.sampling.max_tokens == 1
    assert d_req.transfer.kind == "remote_prefill"
    assert d_req.transfer.source_addr == prefill.kv_address
    assert d_req.transfer.transfer_id == p_req.transfer.transfer_id
    client(router).completions.create(model="tiny", prompt="short", max_tokens=2)
    assert len(prefill.requests()) == 1 and decode.requests()[-1].transfer is None


def test_metadata_unreachable_falls_back_to_load_only(start_router, make_node) -> None:
    router = start_router([make_node()], metadata_address="127.0.0.1:1",
                          metadata_timeout_s=0.2)
    out = client(router).completions.create(model="tiny", prompt="x " * 40, max_tokens=2)
    assert out.usage.completion_tokens == 2
    conn = http.client.HTTPConnection("127.0.0.1", router.app.port, timeout=5)
    conn.request("GET", "/health")
    health = json.loads(conn.getresponse().read())
    assert health["routing"] == "load_only" and health["metadata"]["available"] is False
    conn.request("GET", "/metrics")
    assert "router_metadata_available 0.0" in conn.getresponse().read().decode()


def test_router_imports_no_torch() -> None:
    import subprocess

    # The metadata service's client library is the router's link (docs/architecture.md,
    # decision 3); nothing else of that room, and no heavy package, may load.
    client_library = "{'metadata_service', 'config', 'client', 'errors', 'codec', 'events', 'wire'}"
    code = ("import sys, pdcluster.router.api.server, pdcluster.router.api.handlers\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "{'torch', 'ray', 'engine', 'transformers'} or m.startswith('metadata_service') "
            f"and m.split('.')[-1] not in {client_library}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout.strip() == "[]", proc.stderr


def _wait(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_a_node_that_dies_mid_stream_ends_the_request_with_an_error(start_router,
                                                                    make_node) -> None:
    node = make_node(delay_s=0.05)
    router = start_router([node])
    stream = client(router).completions.create(model="tiny", prompt=TEXT, max_tokens=200,
                                               stream=True)
    next(iter(stream))  # the node is streaming
    started = time.monotonic()
    node.answer_load = False  # the node goes silent: no more load reports
    node.close()             # ... and no more tokens
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    assert time.monotonic() - started < 5, "the router should give up after a few missed polls"
