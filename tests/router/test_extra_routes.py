"""/tokenize, /detokenize and /version in vLLM's shapes, checked against transformers'
tokenizer of the same folder; API keys on them as on /v1/*."""

from __future__ import annotations

import http.client
import json

import pytest

from tests.router.test_http import raw_post

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoTokenizer  # the reference; only the tests import it

    return AutoTokenizer.from_pretrained(model_dir)


def _post(router, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    status, _, payload = raw_post(router, path, json.dumps(body).encode(), headers)
    return status, payload


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"]) if "input_ids" in encoded else list(encoded)


def test_tokenize_a_prompt(start_router, reference) -> None:
    router = start_router([])
    status, out = _post(router, "/tokenize", {"model": "tiny", "prompt": "Hello world"})
    assert status == 200 and set(out) == {"count", "max_model_len", "tokens", "token_strs"}
    assert out["tokens"] == reference("Hello world")["input_ids"]
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 256
    assert out["token_strs"] is None
    _, bare = _post(router, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False,
                                          "return_token_strs": True})
    assert bare["tokens"] == reference("Hello world", add_special_tokens=False)["input_ids"]
    assert bare["token_strs"] == reference.convert_ids_to_tokens(bare["tokens"])


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tokenize_a_chat(start_router, reference, add_generation_prompt) -> None:
    router = start_router([])
    status, out = _post(router, "/tokenize", {"messages": CHAT,
                                              "add_generation_prompt": add_generation_prompt})
    expected = _ids(reference.apply_chat_template(
        CHAT, tokenize=True, add_generation_prompt=add_generation_prompt))
    assert status == 200 and out["tokens"] == expected


def test_detokenize_round_trip(start_router, reference) -> None:
    router = start_router([])
    _, out = _post(router, "/tokenize", {"prompt": "Hello world, this is a test."})
    status, text = _post(router, "/detokenize", {"model": "tiny", "tokens": out["tokens"]})
    assert status == 200 and text == {"prompt": reference.decode(out["tokens"])}
    assert text["prompt"].endswith("Hello world, this is a test.")


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, "prompt"),
    ("/tokenize", {"messages": "hi"}, 400, "messages"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens"),
])
def test_bad_tokenize_requests(start_router, path, body, status, param) -> None:
    router = start_router([])
    got, payload = _post(router, path, body)
    assert (got, payload["error"]["param"]) == (status, param), payload


def test_version(start_router) -> None:
    from importlib.metadata import version

    router = start_router([])
    conn = http.client.HTTPConnection("127.0.0.1", router.app.port, timeout=5)
    conn.request("GET", "/version")
    response = conn.getresponse()
    assert response.status == 200
    assert json.loads(response.read()) == {"version": version("pdcluster")}


def test_api_keys_guard_the_new_endpoints(start_router) -> None:
    router = start_router([], api_keys=("sekrit",))
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        status, payload = _post(router, path, body)
        assert status == 401 and payload["error"]["code"] == "invalid_api_key"
        status, _ = _post(router, path, body, {"Authorization": "Bearer sekrit"})
        assert status == 200
    conn = http.client.HTTPConnection("127.0.0.1", router.app.port, timeout=5)
    conn.request("GET", "/version")
    assert conn.getresponse().status == 401
