"""A tensor-parallel node whose rank dies or stalls mid-step: the real engine (TP=2, gloo on
CPU) behind the real node server and client. The node fails its requests with "internal" (at
once for a dead rank, when `tensor_parallel_timeout_s` runs out for a stalled one; the router
then migrates or recomputes them), leaves no block held, stops serving and reports the loss
(`on_fatal`), which is where a node actor exits so that Ray restarts it."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from pdcluster.core.node_wire import GenerateRequest, RequestError, SamplingSpec, TokenDelta
from pdcluster.engine import LLMEngine
from pdcluster.engine.runner.tp_workers import TensorParallelError
from pdcluster.node.client import BlockingNodeClient
from pdcluster.node.server import NodeServer
from tests.cluster_secret import TEST_CURVE
from tests.helpers import assert_pool_clean

TIMEOUT_S = 8.0  # the ranks' collective timeout here (default 120 s)


@pytest.mark.parametrize("fault", ["dies", "stalls"])
def test_a_rank_that_dies_or_stalls_mid_step_takes_the_node_down_cleanly(model_dirs, fault):
    engine = LLMEngine.from_model(model_dirs["llama-gqa"], num_kv_blocks=64, block_size=8,
                                  device="cpu", dtype="float32", tensor_parallel_size=2,
                                  tensor_parallel_timeout_s=TIMEOUT_S)
    lost: list[Exception] = []
    server = NodeServer(engine, "n-tp", "both", curve=TEST_CURVE, on_fatal=lost.append).start()
    client = BlockingNodeClient(server.address, curve=TEST_CURVE)
    rank1 = engine.peers.processes[0].pid
    try:
        long = SamplingSpec(max_tokens=200, temperature=0.0, ignore_eos=True)
        for name in ("a", "b"):
            client.send(GenerateRequest(name, [3, 4, 5] * 4, long))
        assert isinstance(client.recv(), TokenDelta)
        started = time.monotonic()
        os.kill(rank1, signal.SIGKILL if fault == "dies" else signal.SIGSTOP)
        got = client.collect({"a", "b"}, timeout_s=30)
        waited = time.monotonic() - started
        for name in ("a", "b"):
            error = got[name][-1]
            assert isinstance(error, RequestError) and error.code == "internal"
            assert ("rank 1 exited" if fault == "dies" else
                    f"tensor_parallel_timeout_s, {TIMEOUT_S:g} s") in error.message
        if fault == "dies":
            assert waited < TIMEOUT_S  # told at once, not by a collective's timeout
        else:  # the collective waiting on the stopped rank gave up: no hang
            assert TIMEOUT_S - 1 <= waited < TIMEOUT_S + 10, waited
        while not lost and time.monotonic() - started < 30:  # called right after the errors
            time.sleep(0.01)
        assert len(lost) == 1 and isinstance(lost[0], TensorParallelError)
        assert server.failure is lost[0] and server.draining
        assert_pool_clean(engine.block_pool)
    finally:
        client.close()
        server.stop(drain=False, timeout_s=5)
        if fault == "stalls":
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank1, signal.SIGKILL)
        engine.close()
