"""The router's HTTP edge against hostile or unusual clients: bodies read whole up to the
limit (and refused with 413 past it, chunked or not), invalid Unicode, odd headers, slow
clients (slowloris heads and bodies), unknown routes and methods, unexpected exceptions,
and /health telling whether the router can serve. Raw sockets where a real client would
hide what the server does."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import time

import pytest

from tests.router.test_http import raw_post


def raw_exchange(router, payload: bytes, timeout_s: float = 10.0) -> bytes:
    """Send `payload` on a fresh connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", router.app.port), timeout=timeout_s) as sock:
        sock.sendall(payload)
        return _read_until_closed(sock)


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def _status_and_json(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        body = _unchunk(body)
    return status, json.loads(body)


def _unchunk(body: bytes) -> bytes:
    out = b""
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return out
        out, body = out + rest[:size], rest[size + 2:]
    return out


def _request(path: str, body: bytes, headers: bytes = b"") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n").encode() + headers + \
        b"\r\n" + body


@pytest.mark.parametrize("size", [130 << 10, 600 << 10, 3 << 20])
def test_a_large_valid_body_is_read_whole(start_router, make_node, size) -> None:
    router = start_router([make_node()])
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2,
                       "user": "u" * size}).encode()
    for _ in range(3):  # the partial read was timing-dependent
        status, _, payload = raw_post(router, "/v1/completions", body)
        assert status == 200, payload


def test_a_chunked_body_over_the_limit_is_413(start_router, make_node) -> None:
    router = start_router([make_node()])  # the default limit: 4 MiB
    conn = http.client.HTTPConnection("127.0.0.1", router.app.port, timeout=30)
    chunk = b'{"model": "tiny", "prompt": "' + b"x" * (1 << 20)
    chunks = (chunk if i == 0 else b"x" * (1 << 20) for i in range(50))
    # the server may stop reading once it has answered
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        conn.request("POST", "/v1/completions", body=chunks, encode_chunked=True,
                     headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    payload = json.loads(response.read())
    assert response.status == 413 and payload["error"]["code"] == "request_too_large"


def test_a_small_chunked_body_is_served(start_router, make_node) -> None:
    router = start_router([make_node()])
    conn = http.client.HTTPConnection("127.0.0.1", router.app.port, timeout=10)
    parts = [b'{"model": "tiny", ', b'"prompt": "x", "max_tokens": 2}']
    conn.request("POST", "/v1/completions", body=iter(parts), encode_chunked=True,
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", rb'{"model": "tiny", "prompt": "a\ud800b"}', "prompt"),
    ("/v1/chat/completions",
     rb'{"model": "tiny", "messages": [{"role": "user", "content": "hi \udfff"}]}',
     "messages[0].content"),
    ("/v1/completions", rb'{"model": "tiny", "prompt": "x", "stop": ["\ud83d"]}', "stop[0]"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(start_router, make_node, path, body,
                                                     param) -> None:
    router = start_router([make_node()])
    status, _, payload = raw_post(router, path, body)
    assert status == 400, payload
    assert payload["error"]["param"] == param and payload["error"]["code"] == "invalid_unicode"


def test_a_valid_surrogate_pair_is_fine(start_router, make_node) -> None:
    router = start_router([make_node()])
    status, _, payload = raw_post(router, "/v1/completions",
                                  rb'{"model": "tiny", "prompt": "\ud83d\ude00", '
                                  rb'"max_tokens": 2}')
    assert status == 200, payload


@pytest.mark.parametrize("value", [b"Bearer \xc3\xa9t\xc3\xa9", b"Bearer \xff\xfe",
                                   b"\xe2\x82\xac"])
def test_a_non_ascii_authorization_header_is_401(start_router, make_node, value) -> None:
    router = start_router([make_node()], api_keys=("sekrit",))
    raw = raw_exchange(router, _request("/v1/completions", b'{"model": "tiny", "prompt": "x"}',
                                        b"Authorization: " + value + b"\r\n"))
    status, payload = _status_and_json(raw)
    assert status == 401 and payload["error"]["code"] == "invalid_api_key"


def test_a_slow_request_head_is_cut_off(start_router, make_node) -> None:
    router = start_router([make_node()], header_timeout_s=1.0)
    with socket.create_connection(("127.0.0.1", router.app.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        closed = False
        for i in range(40):  # one header byte every 0.1 s: never a complete head
            try:
                sock.sendall(b"X-a: b\r\n"[i % 8:i % 8 + 1])
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            sock.settimeout(0.1)
            try:
                if sock.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
        assert closed, "the server kept a slow request head open"
        assert time.monotonic() - started < 2.5


def test_a_silent_connection_is_cut_off(start_router, make_node) -> None:
    router = start_router([make_node()], header_timeout_s=0.5)
    with socket.create_connection(("127.0.0.1", router.app.port), timeout=5) as sock:
        started = time.monotonic()
        assert _read_until_closed(sock) == b""
        assert time.monotonic() - started < 2


def test_a_slow_body_is_408_and_closed(start_router, make_node) -> None:
    router = start_router([make_node()], body_timeout_s=1.0)
    with socket.create_connection(("127.0.0.1", router.app.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
        started = time.monotonic()
        data = b""
        for _ in range(60):  # 10 bytes every 0.1 s: 10 s for the whole body
            try:
                sock.sendall(b" " * 10)
            except (BrokenPipeError, ConnectionResetError):
                break
            sock.settimeout(0.1)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            data += chunk
            if not chunk:
                break
        data += _read_until_closed(sock) if data.endswith(b"}") else b""
        assert time.monotonic() - started < 6, "the server kept a slow body open"
    status, payload = _status_and_json(data)
    assert status == 408 and payload["error"]["code"] == "request_timeout"


def test_an_oversized_header_is_431_json(start_router, make_node) -> None:
    router = start_router([make_node()], max_header_bytes=4096)
    raw = raw_exchange(router, _request("/v1/completions", b"{}",
                                        b"X-Big: " + b"a" * 10000 + b"\r\n"))
    status, payload = _status_and_json(raw)
    assert status == 431 and set(payload["error"]) == {"message", "type", "param", "code"}


def test_a_malformed_request_line_is_400_json(start_router, make_node) -> None:
    router = start_router([make_node()])
    status, payload = _status_and_json(raw_exchange(router, b"BLAH\r\n\r\n"))
    assert status == 400 and payload["error"]["code"] == "bad_http_request"


def _get(router, method: str, path: str, headers: dict | None = None
         ) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", router.app.port, timeout=10)
    conn.request(method, path, headers=headers or {})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), json.loads(data)


def test_unknown_routes_and_wrong_methods_are_openai_errors(start_router, make_node) -> None:
    router = start_router([make_node()])
    status, headers, payload = _get(router, "GET", "/v1/nope")
    assert status == 404 and payload["error"]["code"] == "not_found"
    assert headers["Content-Type"].startswith("application/json")
    status, headers, payload = _get(router, "GET", "/v1/completions")
    assert status == 405 and payload["error"]["code"] == "method_not_allowed"
    assert headers["Allow"] == "POST"
    status, headers, payload = _get(router, "DELETE", "/health")
    assert status == 405 and "GET" in headers["Allow"]


def test_an_unexpected_exception_is_a_500_without_traceback(start_router, make_node,
                                                             caplog) -> None:
    router = start_router([make_node()])

    def broken(*args, **kwargs):
        raise RuntimeError("secret internals /etc/passwd")

    router.app.tokenizer.encode = broken  # a bug in the tokenizer path
    status, _, payload = raw_post(router, "/v1/completions", b'{"model": "tiny", "prompt": "x"}')
    assert status == 500 and payload["error"]["code"] == "internal_error"
    assert "secret" not in json.dumps(payload) and "Traceback" not in json.dumps(payload)
    assert "secret internals" in caplog.text  # logged for the operator


def test_health_is_503_without_a_healthy_decode_node(start_router, make_node) -> None:
    router = start_router([make_node("p", role="prefill")])
    time.sleep(0.3)  # a load round: the prefill node is healthy
    status, _, health = _get(router, "GET", "/health")
    assert health["nodes"]["p"]["healthy"] is True
    assert status == 503 and health["status"] == "unavailable"
    assert "decode" in health["reason"]
    router = start_router([make_node("d", role="decode")])
    time.sleep(0.3)
    status, _, health = _get(router, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["reason"] is None


def test_health_without_any_node_is_503(start_router) -> None:
    router = start_router([])
    status, _, health = _get(router, "GET", "/health")
    assert status == 503 and health["reason"] == "no node known"


def test_a_malformed_chunked_body_is_400(start_router, make_node) -> None:
    router = start_router([make_node()])
    raw = raw_exchange(router, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                               b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                               b"5\r\n{\"mod\r\nzz\r\n")
    status, payload = _status_and_json(raw)
    assert status == 400 and payload["error"]["code"] in ("invalid_body", "bad_http_request")


def test_a_client_gone_mid_stream_is_no_error_log(start_router, make_node, caplog) -> None:
    router = start_router([make_node(delay_s=0.05)])
    with socket.create_connection(("127.0.0.1", router.app.port), timeout=5) as sock:
        sock.sendall(_request("/v1/completions", b'{"model": "tiny", "prompt": "x", '
                                                 b'"max_tokens": 100, "stream": true}'))
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    time.sleep(0.5)
    assert "unhandled error" not in caplog.text


def test_a_long_stream_outlives_the_head_timeout(start_router, make_node) -> None:
    from tests.router.test_http import TEXT, client

    router = start_router([make_node(delay_s=0.1)], header_timeout_s=0.5)
    api = client(router)
    for _ in range(2):  # the second request reuses the kept-alive connection
        stream = api.completions.create(model="tiny", prompt="x", max_tokens=16, stream=True)
        text = "".join(c.choices[0].text for c in stream)  # ~1.6 s of tokens
        assert text.startswith(TEXT.split()[0]) and len(text) > len(TEXT)
