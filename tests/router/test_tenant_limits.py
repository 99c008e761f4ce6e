"""Per-tenant limits on requests and tokens in flight (router/planning/tenant_limits.py),
through the real HTTP router and the real `openai` client against a fake node whose first token
comes late (so requests stay in flight): over its limit a tenant gets 429 with Retry-After and
an OpenAI error body, another tenant is served meanwhile, and nothing stays counted after."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable

import openai
import pytest

from pdcluster.router.planning.tenant_limits import TenantLimits
from tests.router.test_http import client

KEYS = ("a:key-a", "b:key-b")


def ask(router, api_key: str, max_tokens: int = 4) -> str:
    out = client(router, api_key).completions.create(model="tiny", prompt="Say hi",
                                                     max_tokens=max_tokens)
    return out.choices[0].text


def in_background(call: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


def metrics_text(router, api_key: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", router.app.port, timeout=5)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {api_key}"})
    return conn.getresponse().read().decode()


def wait_in_flight(router, tenant: str, requests: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if router.app.tenant_limiter.in_flight(tenant)[0] == requests:
            return
        time.sleep(0.01)
    raise AssertionError(f"tenant {tenant} never had {requests} requests in flight")


def test_limits_config_refuses_unknown_keys_by_name() -> None:
    with pytest.raises(ValueError, match="max_request"):
        TenantLimits.from_dict({"max_request": 4})
    with pytest.raises(ValueError, match="tenants.b keys: \\['tokens'\\]"):
        TenantLimits.from_dict({"tenants": {"b": {"tokens": 4}}})
    limits = TenantLimits.from_dict({"max_requests": 2, "tenants": {"b": {"max_tokens": 9}}})
    assert limits.of("a") == (2, None) and limits.of("b") == (None, 9)
    assert TenantLimits.parse_tenant("b::100") == ("b", None, 100)
    with pytest.raises(ValueError, match="NAME:REQUESTS:TOKENS"):
        TenantLimits.parse_tenant("b:x:1")
    with pytest.raises(ValueError, match=">= 1"):
        TenantLimits(max_requests=0)


def test_a_tenant_over_its_request_limit_gets_429(start_router, make_node) -> None:
    node = make_node(ttft_s=1.0)
    router = start_router([node], api_keys=KEYS, tenant_limits=TenantLimits(
        max_requests=1, tenants=(("b", 2, None),)))
    first = in_background(lambda: ask(router, "key-a"))
    wait_in_flight(router, "a", 1)
    with pytest.raises(openai.RateLimitError) as caught:
        ask(router, "key-a")
    assert caught.value.response.headers["retry-after"] == "1"
    assert caught.value.code == "tenant_limit_exceeded"
    assert caught.value.body["type"] == "rate_limit_error"
    started = time.monotonic()
    assert ask(router, "key-b")  # another tenant: served while a is at its limit
    assert time.monotonic() - started < 5.0
    first.join(10)
    assert ask(router, "key-a")  # a's slot came back
    assert router.app.tenant_limiter.in_flight("a") == (0, 0)
    assert "router_tenant_limited_requests_total 1.0" in metrics_text(router, "key-a")


def test_a_tenant_over_its_token_limit_gets_429(start_router, make_node) -> None:
    node = make_node(ttft_s=1.0)
    router = start_router([node], api_keys=KEYS, tenant_limits=TenantLimits(max_tokens=150))
    first = in_background(lambda: ask(router, "key-a", max_tokens=100))
    wait_in_flight(router, "a", 1)
    with pytest.raises(openai.RateLimitError) as caught:
        ask(router, "key-a", max_tokens=100)  # 2 x (prompt + 100) > 150
    assert caught.value.response.headers["retry-after"] == "1"
    assert ask(router, "key-b", max_tokens=100)
    with pytest.raises(openai.BadRequestError) as too_big:
        ask(router, "key-b", max_tokens=200)  # alone over the limit: retrying cannot help
    assert too_big.value.code == "tenant_token_limit"
    first.join(10)
    assert router.app.tenant_limiter.in_flight("a") == (0, 0)
    assert router.app.tenant_limiter.in_flight("b") == (0, 0)
