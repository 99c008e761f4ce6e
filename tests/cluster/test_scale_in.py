"""Scale-in that keeps the cache, on a real local Ray: 2 decode actors (each prefilling its
own prompts), the metadata service, Mooncake over TCP, and the real router in this process
called with the `openai` client.

A decode node that begins draining stops getting requests (its load report says so; /health
shows it, and so does the metadata service's node list), the router hands the hottest
prompts it sent that node to the other node through the pull path (the peer pulls the
blocks, it does not recompute them), the same prompts asked again hit the peer's cache with
the same tokens, the drained node finishes, deregisters and leaves the index, and the
survivor passes the leak check.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.ray_cluster import RayCluster
from pdcluster.metadata_service.client import MetadataClient
from tests.cluster.test_failures import Router, assert_idle_and_leak_free, held_by
from tests.models import random_prompts

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(300)
MODEL = "llama-gqa"
BLOCK = 8


@pytest.fixture(scope="module")
def cluster(model_dirs):
    config = ClusterConfig(model=model_dirs[MODEL], num_prefill=0, num_decode=2,
                           engine={"num_kv_blocks": 256, "block_size": BLOCK}, kv_timeout_s=5,
                           node_cpus=0.5)
    running = RayCluster(config).start()
    yield running
    running.stop(drain_timeout_s=10)


def health(router: Router) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{router.app.port}/health", timeout=10) as r:
        return json.loads(r.read())


def ask(router: Router, prompt: list[int]):
    return router.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                            temperature=0)


def draining_in_index(cluster) -> dict[str, bool]:
    with MetadataClient(cluster.metadata_address, cluster_secret=cluster.cluster_secret) as client:
        return {n.node_id: n.draining for n in client.list_nodes()}


def wait_until(check, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return found


def test_a_draining_node_hands_its_hot_prefixes_to_the_node_that_stays(cluster, model_dirs):
    router = Router(cluster, model_dirs[MODEL], max_migrations=1)
    try:
        router.wait_healthy({"d0", "d1"})
        prompts = random_prompts(6, 48, 64, seed=37)
        before = [ask(router, p) for p in prompts]
        served = {a[0].decision.decode_node for a in router.attempts}
        leaving = max(sorted(served), key=lambda n: sum(
            a[0].decision.decode_node == n for a in router.attempts))
        staying = ({"d0", "d1"} - {leaving}).pop()
        mine = [p for p, a in zip(prompts, router.attempts, strict=True)
                if a[0].decision.decode_node == leaving]
        for prompt in mine:  # indexed before the drain
            wait_until(lambda p=prompt: held_by(cluster, p).get(leaving), "never indexed")

        assert draining_in_index(cluster) == {"d0": False, "d1": False}
        ray.get(cluster.actors[leaving].begin_drain.remote(), timeout=30)
        wait_until(lambda: draining_in_index(cluster) == {leaving: True, staying: False},
                   "the index never showed the node draining", timeout_s=10)
        status = wait_until(lambda: health(router)["draining"].get(leaving, {}).get(
            "handoff") == "done" and health(router)["draining"][leaving], "no hand-off")
        assert health(router)["nodes"][leaving]["draining"] is True
        assert status["prefixes"] == len(mine) and status["failed"] == 0
        assert status["peers"] == {staying: len(mine)}
        stats = ray.get(cluster.actors[staying].transfer_stats.remote(), timeout=30)
        assert stats["blocks_pulled"] >= sum(len(p) // BLOCK - 1 for p in mine)

        router.attempts.clear()
        after = [ask(router, p) for p in prompts]
        assert {a[0].decision.decode_node for a in router.attempts} == {staying}
        assert [a.choices[0].text for a in after] == [b.choices[0].text for b in before]
        cached = {tuple(p): a.usage.prompt_tokens_details.cached_tokens
                  for p, a in zip(prompts, after, strict=True)}
        assert all(cached[tuple(p)] >= (len(p) // BLOCK - 1) * BLOCK for p in mine)

        assert ray.get(cluster.actors[leaving].drain.remote(5.0), timeout=30)
        wait_until(lambda: all(leaving not in held_by(cluster, p) for p in prompts),
                   "the drained node's blocks stayed in the index")
        assert_idle_and_leak_free(cluster, [staying])
    finally:
        router.stop()
