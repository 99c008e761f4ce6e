"""A tensor-parallel node whose rank dies mid-step: the real engine (TP=2, gloo on CPU) behind
the real node server and client. The node fails its requests with "internal" at once (the
router then migrates or recomputes them), leaves no block held, stops serving and reports the
loss (`on_fatal`), which is where a node actor exits so that Ray restarts it."""

from __future__ import annotations

import os
import signal
import time

from pdcluster.core.node_wire import GenerateRequest, RequestError, SamplingSpec, TokenDelta
from pdcluster.engine import LLMEngine
from pdcluster.engine.runner.tp_workers import TensorParallelError
from pdcluster.node.client import BlockingNodeClient
from pdcluster.node.server import NodeServer
from tests.cluster_secret import TEST_CURVE
from tests.helpers import assert_pool_clean


def test_a_rank_that_dies_mid_step_takes_the_node_down_cleanly(model_dirs):
    engine = LLMEngine.from_model(model_dirs["llama-gqa"], num_kv_blocks=64, block_size=8,
                                  device="cpu", dtype="float32", tensor_parallel_size=2)
    lost: list[Exception] = []
    server = NodeServer(engine, "n-tp", "both", curve=TEST_CURVE, on_fatal=lost.append).start()
    client = BlockingNodeClient(server.address, curve=TEST_CURVE)
    try:
        long = SamplingSpec(max_tokens=200, temperature=0.0, ignore_eos=True)
        for name in ("a", "b"):
            client.send(GenerateRequest(name, [3, 4, 5] * 4, long))
        assert isinstance(client.recv(), TokenDelta)
        started = time.monotonic()
        os.kill(engine.peers.processes[0].pid, signal.SIGKILL)
        got = client.collect({"a", "b"}, timeout_s=30)
        for name in ("a", "b"):
            error = got[name][-1]
            assert isinstance(error, RequestError) and error.code == "internal"
            assert "rank 1" in error.message
        assert time.monotonic() - started < 10  # not a collective's timeout
        while not lost and time.monotonic() - started < 10:  # called right after the errors
            time.sleep(0.01)
        assert len(lost) == 1 and isinstance(lost[0], TensorParallelError)
        assert server.failure is lost[0] and server.draining
        assert_pool_clean(engine.block_pool)
    finally:
        client.close()
        server.stop(drain=False, timeout_s=5)
        engine.close()
