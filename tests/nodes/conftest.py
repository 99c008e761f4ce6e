"""`node`: one `NodeServer` on the tiny llama-gqa model (128 KV blocks of 8 tokens) and a
blocking client of it, both closed after the test."""

from __future__ import annotations

import pytest


@pytest.fixture
def node(model_dirs):
    from pdcluster.engine import LLMEngine
    from pdcluster.node.client import BlockingNodeClient
    from pdcluster.node.server import NodeServer
    from tests.cluster_secret import TEST_CURVE

    engine = LLMEngine.from_model(model_dirs["llama-gqa"], num_kv_blocks=128, block_size=8)
    server = NodeServer(engine, "n0", "both", curve=TEST_CURVE).start()
    client = BlockingNodeClient(server.address, curve=TEST_CURVE)
    yield server, client
    client.close()
    server.stop(drain=False)
