"""A prefill node dying under a disaggregated request, against fake nodes over ZMQ: the router
sees its connection close and tells the decode node at once (`PrefillLost`, naming the
request and its transfer), so the decode node stops waiting for KV that will never come. So
does a prefill node that refuses the request for a reason of its own (overloaded): the
decode node computes the prompt and the request succeeds. A prefill node that only hangs
(connected, silent) is not reported: it may still write — until its connection closes."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from pdcluster.core.node_wire import PrefillLost
from pdcluster.router.routing.policy import PolicyConfig
from tests.router.test_failures import client, wait_until

pytestmark = pytest.mark.timeout(60)


def start_disaggregated(start_router, make_node, decode_ttft_s: float = 30.0,
                        prefill_ttft_s: float = 30.0, **prefill_options):
    """A router in front of prefill node p0 and decode node d0 that both hold every request
    (D "waits for its KV" `decode_ttft_s`), with one streaming request sent through both;
    its outcome lands in the returned list (an exception, or "done")."""
    prefill = make_node("p0", role="prefill", ttft_s=prefill_ttft_s, **prefill_options)
    decode = make_node("d0", role="decode", ttft_s=decode_ttft_s)
    router = start_router([prefill, decode], policy=PolicyConfig(local_prefill_threshold=0))
    wait_until(lambda: all(n.healthy for n in router.app.dispatcher.nodes.values()))
    outcome: list[object] = []

    def call() -> None:
        try:
            list(client(router).completions.create(model="tiny", prompt="Hello world",
                                                   max_tokens=4, stream=True))
            outcome.append("done")
        except openai.APIError as exc:
            outcome.append(exc)

    threading.Thread(target=call, daemon=True).start()
    wait_until(lambda: prefill.requests() and decode.requests())
    return router, prefill, decode, outcome


def notices(node) -> list[PrefillLost]:
    return [m for m in node.received if isinstance(m, PrefillLost)]


def test_a_dead_prefill_node_is_reported_to_the_decode_node_at_once(start_router, make_node):
    router, prefill, decode, _ = start_disaggregated(start_router, make_node)
    (d_request,) = decode.requests()
    killed = time.monotonic()
    prefill.close()
    wait_until(lambda: notices(decode), timeout_s=2.0)
    assert time.monotonic() - killed < 1.0
    (notice,) = notices(decode)
    assert notice.request_id == d_request.request_id
    assert notice.transfer_id == d_request.transfer.transfer_id
    assert "p0" in notice.reason
    assert lost_count(router, "lost") == 1


def test_a_prefill_node_dying_after_its_part_but_before_the_kv_arrived_is_reported(
        start_router, make_node):
    # P answered (its one token: its KV is pinned, waiting for D to ask), D is still queued
    router, prefill, decode, _ = start_disaggregated(start_router, make_node,
                                                     prefill_ttft_s=0.0)
    wait_until(lambda: not prefill.num_active())
    time.sleep(0.2)
    assert notices(decode) == []  # P finishing its part is not news
    killed = time.monotonic()
    prefill.close()
    wait_until(lambda: notices(decode), timeout_s=2.0)
    assert time.monotonic() - killed < 1.0
    (notice,) = notices(decode)
    assert notice.transfer_id == decode.requests()[0].transfer.transfer_id
    assert lost_count(router, "lost") == 1


def test_a_prefill_node_dying_after_the_decode_node_began_is_not_news(start_router,
                                                                      make_node):
    router, prefill, decode, outcome = start_disaggregated(
        start_router, make_node, prefill_ttft_s=0.0, decode_ttft_s=0.0)
    wait_until(lambda: outcome, timeout_s=5.0)
    prefill.close()
    time.sleep(0.5)
    assert outcome == ["done"] and notices(decode) == []
    assert lost_count(router, "lost") == 0


def test_a_prefill_node_that_is_overloaded_lets_the_decode_node_compute(start_router,
                                                                        make_node):
    router, prefill, decode, outcome = start_disaggregated(
        start_router, make_node, decode_ttft_s=0.5, refuse="overloaded")
    wait_until(lambda: notices(decode), timeout_s=2.0)
    (notice,) = notices(decode)
    assert notice.transfer_id == decode.requests()[0].transfer.transfer_id
    assert "overloaded" in notice.reason
    assert lost_count(router, "refused") == 1
    # the decode node (a fake: it "computes" for 0.5 s) streams the request to its end
    wait_until(lambda: outcome, timeout_s=5.0)
    assert outcome == ["done"] and not decode.aborts()


def lost_count(router, why: str) -> float:
    return router.app.metrics.prefill_lost.labels(why)._value.get()


def test_a_hung_prefill_node_is_not_reported(start_router, make_node):
    router, prefill, decode, _ = start_disaggregated(start_router, make_node)
    prefill.frozen = True  # connected but silent: the router stops trusting it, nothing more
    wait_until(lambda: not router.app.dispatcher.nodes["p0"].healthy, timeout_s=5.0)
    time.sleep(2.0)  # past the missed polls that end its streams
    assert notices(decode) == []
    assert lost_count(router, "lost") == 0


def test_a_hung_prefill_node_that_then_dies_is_reported(start_router, make_node):
    router, prefill, decode, _ = start_disaggregated(start_router, make_node)
    prefill.frozen = True
    link = router.app.dispatcher.nodes["p0"]
    wait_until(lambda: link.num_inflight == 0, timeout_s=10.0)  # missed polls ended its stream
    assert notices(decode) == [] and not link.disconnected
    killed = time.monotonic()
    prefill.close()  # it was not only hung: it died, and its KV will never come
    wait_until(lambda: notices(decode), timeout_s=2.0)
    assert time.monotonic() - killed < 1.0
    (notice,) = notices(decode)
    assert notice.transfer_id == decode.requests()[0].transfer.transfer_id
    assert lost_count(router, "lost") == 1
