"""The live router's work count: `Dispatcher` charges each node the work it sends there (on an
injected clock) and routes on the decayed totals, against fake nodes over ZMQ."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdcluster.core.node_wire import GenerateRequest, SamplingSpec, TokenDelta
from pdcluster.router.config import NodeSpec, RouterConfig
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.routing.dispatch import Dispatcher
from pdcluster.router.routing.policy import PolicyConfig
from tests.cluster_secret import ROUTER_CREDENTIALS, TEST_CURVE

HALF_LIFE_S = 30.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id, list(range(1, num_prompt_tokens + 1)),
                           SamplingSpec(max_tokens=max_tokens, temperature=0.0))


async def send(dispatcher: Dispatcher, request: GenerateRequest) -> tuple[str, int]:
    """Place and run one request to the end; returns (decode node, tokens received)."""
    placement = await dispatcher.place(request.prompt_token_ids, None)
    deltas = [d async for d in dispatcher.execute(placement, request)]
    assert all(isinstance(d, TokenDelta) for d in deltas)
    return placement.decision.decode_node, sum(len(d.token_ids) for d in deltas)


def test_dispatched_work_is_counted_decayed_and_routed_on(make_node) -> None:
    nodes = [make_node("a"), make_node("b")]
    config = RouterConfig(
        model_dir="unused", nodes=tuple(NodeSpec(n.node_id, n.role, n.address) for n in nodes),
        load_interval_s=60.0, node_timeout_s=1.0, seed=0, **ROUTER_CREDENTIALS,
        policy=PolicyConfig(work_half_life_s=HALF_LIFE_S, output_token_weight=10.0))
    clock = FakeClock()

    async def scenario() -> None:
        dispatcher = Dispatcher(config, RouterMetrics(), clock=clock, shared_keys=TEST_CURVE)
        await dispatcher.start()
        try:
            first, num_tokens = await send(dispatcher, make_request("r1", 100, 4))
            assert num_tokens == 4
            assert dispatcher.work.value(first, clock.now) == 100 + 10.0 * 4
            clock.now += HALF_LIFE_S
            assert dispatcher.work.value(first, clock.now) == pytest.approx(70.0)
            await dispatcher.refresh()  # the nodes report empty queues again
            # the live load is equal; only the work sent to `first` tells the nodes apart
            second, _ = await send(dispatcher, make_request("r2", 100, 4))
            assert second != first
            assert dispatcher.work.value(second, clock.now) == 140.0
        finally:
            await dispatcher.close()

    asyncio.run(scenario())


def test_remote_prefill_charges_the_prompt_to_p_and_the_output_to_d(make_node) -> None:
    nodes = [make_node("p", role="prefill"), make_node("d", role="decode")]
    config = RouterConfig(
        model_dir="unused", nodes=tuple(NodeSpec(n.node_id, n.role, n.address, n.kv_address)
                                        for n in nodes),
        load_interval_s=60.0, node_timeout_s=1.0, **ROUTER_CREDENTIALS,
        policy=PolicyConfig(local_prefill_threshold=16, output_token_weight=10.0))
    clock = FakeClock()

    async def scenario() -> None:
        dispatcher = Dispatcher(config, RouterMetrics(), clock=clock, shared_keys=TEST_CURVE)
        await dispatcher.start()
        try:
            decode_node, num_tokens = await send(dispatcher, make_request("r1", 200, 3))
            assert decode_node == "d" and num_tokens == 3
            assert dispatcher.work.value("p", clock.now) == 200
            assert dispatcher.work.value("d", clock.now) == 10.0 * 3
        finally:
            await dispatcher.close()

    asyncio.run(scenario())


def test_closing_right_after_a_node_re_registered_does_not_hang(make_node) -> None:
    """A node that registers again (a restart: a new epoch, a new address) gets a new link;
    the old one closes in the background. A router stopped in that instant used to cancel
    that close before it ran, and the ZMQ context's termination then waited for the old
    socket forever (CI saw the router's stop time out)."""
    old, new = make_node("a"), make_node("a")
    config = RouterConfig(model_dir="unused", nodes=(NodeSpec("a", "both", old.address),),
                          load_interval_s=60.0, node_timeout_s=1.0, **ROUTER_CREDENTIALS)
    outcome: list[BaseException | None] = []

    async def scenario() -> None:
        dispatcher = Dispatcher(config, RouterMetrics(), shared_keys=TEST_CURVE)
        await dispatcher.start()
        replaced = dispatcher.nodes["a"]
        dispatcher._sync_nodes([NodeSpec("a", "both", new.address)])  # the refresh's path
        assert dispatcher.nodes["a"] is not replaced
        await dispatcher.close()  # at once: the old link's close has not run yet

    def run() -> None:
        try:
            asyncio.run(scenario())
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            outcome.append(exc)

    # a hang blocks the event loop itself (a synchronous ZMQ call), so watch from outside
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(15)
    assert not thread.is_alive(), "Dispatcher.close hung on a replaced node's socket"
    assert outcome == [None]
