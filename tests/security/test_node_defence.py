"""Defence in depth on a node, attacked through its real ZMQ request socket (CURVE, the
cluster's keys: these are attacks by a peer that holds credentials, or a bug in one):
- a request with NaN temperature, logprobs=100000 or an out-of-vocabulary stop id is refused
  alone ("invalid_request", naming the field), and a stream already running on the node
  finishes with exactly transformers' tokens;
- a flood of 70 remote_decode requests whose decode node never asks for the KV cannot starve
  the node: most are refused ("overloaded"), the rest are released after the pin timeout, and
  a normal request's end-to-end latency stays within 2x of the same request on the idle node
  (medians of 5 runs of 128 tokens each, so that a noisy machine does not decide);
- a request whose output cannot be sent fails alone ("internal"); the others stream on.
Every scenario ends with the pool leak-checked."""

from __future__ import annotations

import statistics
import time

import pytest

from pdcluster.core.node_wire import (
    GenerateRequest,
    RequestError,
    SamplingSpec,
    TokenDelta,
    TransferSpec,
)
from pdcluster.node.client import BlockingNodeClient, tokens_of
from pdcluster.node.server import NodeServer
from tests.cluster_secret import TEST_CURVE
from tests.helpers import assert_pool_clean
from tests.models import random_prompts
from tests.transfer.disagg import make_engine
from tests.transfer.loopback import LoopbackFabric

STREAM = SamplingSpec(max_tokens=24, temperature=0.0, ignore_eos=True)


def wait_idle(server: NodeServer, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while server.engine.has_unfinished_requests() or server.engine.has_pinned_blocks():
        assert time.monotonic() < deadline, "node did not become idle"
        time.sleep(0.01)


@pytest.mark.parametrize("bad, field", [
    (SamplingSpec(temperature=float("nan")), "temperature"),
    (SamplingSpec(temperature=float("inf")), "temperature"),
    (SamplingSpec(logprobs=100_000), "logprobs"),
    (SamplingSpec(min_tokens=2, stop_token_ids=[10**9]), "stop_token_ids"),
    (SamplingSpec(seed=2**64 - 1, top_p=float("nan")), "top_p"),
], ids=["nan-temperature", "inf-temperature", "huge-logprobs", "out-of-vocab-stop-id",
        "nan-top-p"])
def test_a_bad_request_is_refused_and_a_concurrent_stream_finishes_intact(
        node, model_dirs, hf_reference, bad, field):
    server, client = node
    prompt = random_prompts(1, 12, 12, seed=80)[0]
    client.send(GenerateRequest("stream", prompt, STREAM))
    first = client.recv()
    assert isinstance(first, TokenDelta) and not first.finished  # in flight
    client.send(GenerateRequest("bad", [1, 2, 3], bad))
    got = client.collect({"stream", "bad"})
    (refusal,) = got["bad"]
    assert isinstance(refusal, RequestError) and refusal.code == "invalid_request"
    assert field in refusal.message
    stream = [first] + got["stream"]
    assert tokens_of(stream) == hf_reference(model_dirs["llama-gqa"], prompt, 24)
    assert stream[-1].finished and stream[-1].finish_reason == "length"
    wait_idle(server)
    assert server.stats.num_refused == 1
    assert_pool_clean(server.engine.block_pool)


def test_a_request_whose_output_cannot_be_sent_fails_alone(node, model_dirs, hf_reference,
                                                           monkeypatch):
    server, client = node
    send_delta = server._send_delta

    def faulty(out):
        if out.request_id == "bad" and len(out.token_ids) >= 3:
            raise ValueError("injected: cannot encode")
        send_delta(out)

    monkeypatch.setattr(server, "_send_delta", faulty)
    prompts = random_prompts(2, 10, 10, seed=83)
    client.send(GenerateRequest("stream", prompts[0], STREAM))
    client.send(GenerateRequest("bad", prompts[1], STREAM))
    got = client.collect({"stream", "bad"})
    assert isinstance(got["bad"][-1], RequestError) and got["bad"][-1].code == "internal"
    assert len(tokens_of(got["bad"])) == 2
    assert tokens_of(got["stream"]) == hf_reference(model_dirs["llama-gqa"], prompts[0], 24)
    wait_idle(server)
    assert_pool_clean(server.engine.block_pool)


def timed(client: BlockingNodeClient, request_id: str, prompt: list[int],
          spec: SamplingSpec) -> float:
    """End-to-end seconds of one request, from sending to its last token."""
    started = time.perf_counter()
    client.send(GenerateRequest(request_id, prompt, spec))
    got = client.collect({request_id}, timeout_s=20)[request_id]
    assert len(tokens_of(got)) == spec.max_tokens, got[-1]
    return time.perf_counter() - started


def test_a_remote_decode_flood_leaves_normal_latency_within_2x(model_dirs):
    """70 remote_decode requests of 4 blocks each (280 blocks against a 128-block pool) whose
    decode node never asks. Before the pin budget they filled the pool for the connector's
    whole 30 s timeout and a normal request queued behind them."""
    engine = make_engine(model_dirs["llama-gqa"], LoopbackFabric().transport(),
                         timeout_s=30.0, num_kv_blocks=128, block_size=8, pin_timeout_s=4.0)
    server = NodeServer(engine, "p0", "prefill", curve=TEST_CURVE).start()
    client, flooder = (BlockingNodeClient(server.address, curve=TEST_CURVE) for _ in range(2))
    normal = random_prompts(1, 16, 16, seed=81)[0]
    spec = SamplingSpec(max_tokens=128, temperature=0.0, ignore_eos=True)
    try:
        timed(client, "warm-up", normal, spec)
        idle = statistics.median(timed(client, f"idle{i}", normal, spec) for i in range(5))
        for i, prompt in enumerate(random_prompts(70, 32, 32, seed=82)):
            flooder.send(GenerateRequest(f"f{i}", prompt, SamplingSpec(max_tokens=1),
                                         TransferSpec("remote_decode", f"t{i}")))
        flooded = statistics.median(timed(client, f"busy{i}", normal, spec) for i in range(5))
        replies = flooder.collect({f"f{i}" for i in range(70)})
        refused = [r for r in replies.values() if isinstance(r[0], RequestError)]
        assert all(r[0].code == "overloaded" for r in refused)
        assert 50 <= len(refused) < 70  # 64 of 128 blocks may be pinned: 16 admitted
        assert flooded <= 2 * idle, f"normal request: {flooded:.3f} s flooded, {idle:.3f} s idle"
        wait_idle(server)  # the admitted ones expire after pin_timeout_s
        assert engine.stats()["num_pins_expired"] == 70 - len(refused)
        assert_pool_clean(engine.block_pool)
    finally:
        for c in (client, flooder):
            c.close()
        server.stop(drain=False)
        engine.close()
