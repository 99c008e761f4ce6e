"""Router test fixtures: a tokenizer-only model folder, fake nodes, and a router serving
HTTP on 127.0.0.1 from a background event loop (so the sync `openai` client can call it)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pdcluster.router.api.server import RouterApp
from pdcluster.router.config import NodeSpec, RouterConfig
from tests.cluster_secret import ROUTER_CREDENTIALS, TEST_CURVE
from tests.router.fake_node import FakeNode

MAX_MODEL_LEN = 256
# "Hello world, this is a test." in the tiny model's tokenizer
SCRIPT = (22557, 1526, 28725, 456, 349, 264, 1369, 28723)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder with only what the router reads: tokenizer files and config.json."""
    from pdcluster.engine.models.tiny_model import write_tokenizer

    out = tmp_path_factory.mktemp("tiny-model")
    write_tokenizer(out, MAX_MODEL_LEN)
    (out / "config.json").write_text(json.dumps(
        {"max_position_embeddings": MAX_MODEL_LEN, "eos_token_id": 2, "bos_token_id": 1}))
    return out


class RunningRouter:
    def __init__(self, app: RouterApp, loop: asyncio.AbstractEventLoop) -> None:
        self.app, self.loop = app, loop

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.app.port}/v1"

    def call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@pytest.fixture
def start_router(model_dir: Path) -> Iterator[Callable[..., RunningRouter]]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    started: list[RouterApp] = []

    def start(nodes: list[FakeNode] | None = None, **overrides) -> RunningRouter:
        specs = tuple(NodeSpec(n.node_id, n.role, n.address, n.kv_address)
                      for n in nodes or [])
        config = RouterConfig(**{"model_dir": str(model_dir), "model_name": "tiny", "port": 0,
                                 "nodes": specs, "load_interval_s": 0.1, "node_timeout_s": 0.5,
                                 **ROUTER_CREDENTIALS, **overrides})
        app = RouterApp(config, shared_keys=TEST_CURVE)
        asyncio.run_coroutine_threadsafe(app.start(), loop).result(10)
        started.append(app)
        return RunningRouter(app, loop)

    yield start
    for app in started:
        asyncio.run_coroutine_threadsafe(app.stop(), loop).result(10)
    asyncio.run_coroutine_threadsafe(_cancel_leftovers(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


async def _cancel_leftovers() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture
def make_node() -> Iterator[Callable[..., FakeNode]]:
    nodes: list[FakeNode] = []

    def make(node_id: str = "n0", script: list[int] | None = None, **kwargs) -> FakeNode:
        node = FakeNode(node_id, script or list(SCRIPT),
                        **kwargs)
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.close()
