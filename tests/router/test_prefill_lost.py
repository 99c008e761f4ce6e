"""A prefill node dying under a disaggregated request, against fake nodes over ZMQ: the router
sees its connection close and tells the decode node at once (`PrefillLost`, naming the
request and its transfer), so the decode node stops waiting for KV that will never come.
A prefill node that only hangs (connected, silent) is not reported: it may still write."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from pdcluster.core.node_wire import PrefillLost
from pdcluster.router.routing.policy import PolicyConfig
from tests.router.test_failures import client, wait_until

pytestmark = pytest.mark.timeout(60)


def start_disaggregated(start_router, make_node, ttft_s: float = 30.0):
    """A router in front of prefill node p0 and decode node d0 that both hold every request
    (D "waits for its KV"), with one streaming request sent through both."""
    prefill = make_node("p0", role="prefill", ttft_s=ttft_s)
    decode = make_node("d0", role="decode", ttft_s=ttft_s)
    router = start_router([prefill, decode], policy=PolicyConfig(local_prefill_threshold=0))
    wait_until(lambda: all(n.healthy for n in router.app.dispatcher.nodes.values()))
    errors: list[Exception] = []

    def call() -> None:
        try:
            list(client(router).completions.create(model="tiny", prompt="Hello world",
                                                   max_tokens=4, stream=True))
        except openai.APIError as exc:
            errors.append(exc)

    threading.Thread(target=call, daemon=True).start()
    wait_until(lambda: prefill.requests() and decode.requests())
    return router, prefill, decode


def notices(node) -> list[PrefillLost]:
    return [m for m in node.received if isinstance(m, PrefillLost)]


def test_a_dead_prefill_node_is_reported_to_the_decode_node_at_once(start_router, make_node):
    router, prefill, decode = start_disaggregated(start_router, make_node)
    (d_request,) = decode.requests()
    killed = time.monotonic()
    prefill.close()
    wait_until(lambda: notices(decode), timeout_s=2.0)
    assert time.monotonic() - killed < 1.0
    (notice,) = notices(decode)
    assert notice.request_id == d_request.request_id
    assert notice.transfer_id == d_request.transfer.transfer_id
    assert "p0" in notice.reason
    assert router.app.metrics.prefill_lost._value.get() == 1


def test_a_hung_prefill_node_is_not_reported(start_router, make_node):
    router, prefill, decode = start_disaggregated(start_router, make_node)
    prefill.frozen = True  # connected but silent: the router stops trusting it, nothing more
    wait_until(lambda: not router.app.dispatcher.nodes["p0"].healthy, timeout_s=5.0)
    time.sleep(2.0)  # past the missed polls that end its streams
    assert notices(decode) == []
    assert router.app.metrics.prefill_lost._value.get() == 0
