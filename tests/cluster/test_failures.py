"""Nodes dying under the router, on a real local Ray: 1 prefill + 2 decode actors, the metadata
service, Mooncake over TCP, and the real router in this process, called with the `openai`
client.

- A decode actor killed mid-stream: the stream moves to the other decode node and its tokens
  are exactly what `transformers` generates greedily; with `max_migrations=0` it ends with a
  clean error instead. Either way the survivors pass the leak check, and the killed
  incarnation's blocks leave the metadata index.
- A prefill actor dead when the router sends it its part: the decode node times out on the
  KV, recomputes the prompt, and the request succeeds with exact tokens.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import openai
import pytest
import ray

from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.ray_cluster import RayCluster
from pdcluster.core.credentials import SERVICE
from pdcluster.core.hashing import hash_block_tokens
from pdcluster.metadata_service.client import MetadataClient
from pdcluster.router.api.server import RouterApp
from pdcluster.router.config import RouterConfig
from pdcluster.router.routing.policy import PolicyConfig
from tests.models import random_prompts

pytestmark = pytest.mark.timeout(300)
MODEL = "llama-gqa"
BLOCK = 8
N_OUT = 256  # long enough to kill the decode node while it streams
EOS = 2


@pytest.fixture(scope="module")
def cluster(model_dirs):
    config = ClusterConfig(model=model_dirs[MODEL], num_prefill=1, num_decode=2,
                           engine={"num_kv_blocks": 256, "block_size": BLOCK}, kv_timeout_s=3,
                           node_cpus=0.5)
    running = RayCluster(config).start()
    yield running
    running.stop(drain_timeout_s=10)


class Router:
    """A RouterApp on a background event loop, with every node attempt recorded."""

    def __init__(self, cluster, model_dir: str, max_migrations: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = RouterConfig(model_dir=model_dir, port=0,
                              metadata_address=cluster.metadata_address,
                              metadata_token=cluster.cluster_secret.metadata_token(SERVICE),
                              policy=PolicyConfig(local_prefill_threshold=16),
                              load_interval_s=0.2, node_timeout_s=1.0,
                              max_migrations=max_migrations)
        self.app = RouterApp(config)
        self.call(self.app.start())
        self.attempts: list[tuple] = []  # (placement, node request, tokens streamed)
        self.dispatcher = self.app.dispatcher
        execute = self.dispatcher.execute

        async def recorded(placement, request):
            tokens: list[int] = []
            self.attempts.append((placement, request, tokens))
            async for delta in execute(placement, request):
                tokens += delta.token_ids
                yield delta

        self.dispatcher.execute = recorded
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.app.port}/v1",
                                    api_key="none", max_retries=0, timeout=60)

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_healthy(self, node_ids: set[str], timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while {n for n, c in self.dispatcher.nodes.items() if c.healthy} != node_ids:
            assert time.monotonic() < deadline, "the router never saw every node healthy"
            time.sleep(0.1)

    def serving_decode_node(self) -> str:
        (node_id,) = [n for n, c in self.dispatcher.nodes.items()
                      if c.spec.role == "decode" and c.num_inflight]
        return node_id

    def metric(self, name: str) -> float:
        text = self.app.metrics.render().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name))

    def stop(self) -> None:
        self.call(self.app.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def start_router(cluster, model_dirs):
    started: list[Router] = []

    def start(max_migrations: int) -> Router:
        router = Router(cluster, model_dirs[MODEL], max_migrations)
        started.append(router)
        router.wait_healthy({"p0", "d0", "d1"})
        return router

    yield start
    for router in started:
        router.stop()


def until_eos(tokens: list[int]) -> list[int]:
    """The router stops at EOS; the reference does not."""
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens


def stream_request(router: Router, prompt: list[int]):
    return iter(router.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=N_OUT, temperature=0, stream=True,
        stream_options={"include_usage": True}))


def epochs(cluster) -> dict[str, int]:
    with MetadataClient(cluster.metadata_address, cluster_secret=cluster.cluster_secret) as client:
        return {n.node_id: n.epoch for n in client.list_nodes()}


def held_by(cluster, prompt: list[int]) -> dict[str, int]:
    with MetadataClient(cluster.metadata_address, cluster_secret=cluster.cluster_secret) as client:
        return dict(client.query(hash_block_tokens(prompt, BLOCK)))


def wait_reregistered(cluster, node_id: str, old_epoch: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while epochs(cluster).get(node_id) in (None, old_epoch):
        assert time.monotonic() < deadline, f"{node_id} did not come back"
        time.sleep(0.1)


def assert_idle_and_leak_free(cluster, node_ids) -> None:
    for node_id in node_ids:
        deadline = time.monotonic() + 30
        while True:
            state = ray.get(cluster.actors[node_id].pool_state.remote(), timeout=30)
            if not state["num_unfinished"] and not state["num_pinned_requests"]:
                break
            assert time.monotonic() < deadline, f"{node_id} did not become idle: {state}"
            time.sleep(0.1)
        assert state["num_held_blocks"] == 0 and state["num_free_blocks"] == state["num_blocks"]


def kill_serving_decode_node(cluster, router: Router, prompt: list[int]) -> tuple[str, int]:
    victim = router.serving_decode_node()
    deadline = time.monotonic() + 10
    while held_by(cluster, prompt).get(victim) != len(prompt) // BLOCK:  # indexed first
        assert time.monotonic() < deadline, "the decode node's blocks never reached the index"
        time.sleep(0.02)
    old_epoch = epochs(cluster)[victim]
    ray.kill(cluster.actors[victim], no_restart=False)
    return victim, old_epoch


def test_a_decode_actor_killed_mid_stream_hands_the_stream_over_exactly(
        cluster, start_router, model_dirs, hf_reference):
    router = start_router(max_migrations=1)
    prompt = random_prompts(1, 40, 40, seed=80)[0]
    stream = stream_request(router, prompt)
    chunks = [next(stream) for _ in range(3)]
    victim, old_epoch = kill_serving_decode_node(cluster, router, prompt)
    chunks += list(stream)

    (_, _, first_tokens), (_, moved, moved_tokens) = router.attempts
    assert moved.prompt_token_ids == prompt + first_tokens and len(first_tokens) >= 3
    assert moved.sampling.max_tokens == N_OUT - len(first_tokens)
    expected = until_eos(hf_reference(model_dirs[MODEL], prompt, N_OUT))
    assert first_tokens + moved_tokens == expected
    assert len({c.id for c in chunks}) == 1 and "".join(c.choices[0].text for c in chunks
                                                         if c.choices)
    assert chunks[-1].usage.completion_tokens == len(expected)
    assert chunks[-1].usage.prompt_tokens == len(prompt)
    assert router.metric("router_migrations_total") == 1

    survivors = {"p0", "d0", "d1"} - {victim}
    assert_idle_and_leak_free(cluster, survivors)
    wait_reregistered(cluster, victim, old_epoch)
    assert victim not in held_by(cluster, prompt)


def test_with_no_migration_allowed_a_killed_decode_actor_ends_the_stream_cleanly(
        cluster, start_router):
    router = start_router(max_migrations=0)
    prompt = random_prompts(1, 40, 40, seed=81)[0]
    stream = stream_request(router, prompt)
    next(stream)
    victim, old_epoch = kill_serving_decode_node(cluster, router, prompt)
    killed = time.monotonic()
    with pytest.raises(openai.APIError, match=f"node {victim} disconnected"):
        for _ in stream:
            pass
    assert time.monotonic() - killed < 5
    assert len(router.attempts) == 1 and router.metric("router_migrations_total") == 0
    assert_idle_and_leak_free(cluster, {"p0", "d0", "d1"} - {victim})
    wait_reregistered(cluster, victim, old_epoch)
    assert victim not in held_by(cluster, prompt)


def test_a_prefill_actor_dead_when_the_router_sends_makes_decode_recompute(
        cluster, start_router, model_dirs, hf_reference):
    router = start_router(max_migrations=1)
    place = router.dispatcher.place

    async def placed_before_p0_died(prompt_ids, cache_salt):
        placement = await place(prompt_ids, cache_salt)
        decision = replace(placement.decision, prefill_node="p0", reason="remote_prefill")
        return replace(placement, decision=decision)

    old_epoch = epochs(cluster)["p0"]
    ray.kill(cluster.actors["p0"], no_restart=False)
    router.dispatcher.place = placed_before_p0_died  # the race: p0 looked healthy
    prompt = random_prompts(1, 40, 40, seed=82)[0]
    out = router.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                           temperature=0)
    ((placement, _, tokens),) = router.attempts
    assert placement.decision.prefill_node == "p0"
    assert tokens == until_eos(hf_reference(model_dirs[MODEL], prompt, 8))
    assert out.usage.completion_tokens == len(tokens)
    assert_idle_and_leak_free(cluster, {"d0", "d1"})
    wait_reregistered(cluster, "p0", old_epoch)
