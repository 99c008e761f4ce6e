"""The live planner on a real local Ray (cluster/planner_actor.py, node_fleet.py,
live_planner.py): it reads the real router's metrics and the nodes' loads, starts a decode
node when the measured inter-token latency misses its SLO, and when the load is gone retires
one — draining it after the router handed its hot prompts to the node that stays — with no
request lost, the same tokens before and after, cache hits on the survivor, and no leaked
block. Decisions are stepped by the test (`PlannerActor.step`) rather than timed."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.planner_settings import PlannerSettings
from pdcluster.cluster.ray_cluster import RayCluster
from tests.cluster.test_failures import Router
from tests.models import random_prompts

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(400)
MODEL = "llama-gqa"
BLOCK = 8


@pytest.fixture(scope="module")
def cluster(model_dirs):
    # an ITL SLO no CPU meets: any measured traffic asks for one more decode node
    settings = PlannerSettings(slo_ttft_s=30.0, slo_itl_ms=0.01, interval_s=1.0, startup_s=5.0,
                               min_prefill=0, max_prefill=0, min_decode=1, max_decode=2,
                               down_cooldown_s=2.0, down_window_s=2.0, rate_half_life_s=1.0,
                               drain_timeout_s=60.0)
    config = ClusterConfig(model=model_dirs[MODEL], num_prefill=0, num_decode=1,
                           engine={"num_kv_blocks": 256, "block_size": BLOCK}, kv_timeout_s=5,
                           node_cpus=0.5, planner=settings)
    running = RayCluster(config).start()
    yield running
    running.stop(drain_timeout_s=10)


def ask(router: Router, prompt: list[int]):
    return router.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                            temperature=0)


def status(cluster) -> dict:
    return ray.get(cluster.planner.status.remote(), timeout=30)


def step(cluster) -> dict | None:
    return ray.get(cluster.planner.step.remote(), timeout=60)


def wait_for_metric(name: str, count: int, timeout_s: float = 40.0) -> list[dict]:
    """The samples of metric `name` on Ray's metrics port (exported every ~10 s), each its
    labels and `value`, once `count` of them are above 0."""
    (node,) = ray.nodes()
    url = f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"
    sample = re.compile(rf"^{name}\{{([^}}]*)\}} (\S+)$", re.M)
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        samples = [{**dict(re.findall(r'(\w+)="([^"]*)"', labels)), "value": float(value)}
                   for labels, value in sample.findall(text)]
        if sum(s["value"] > 0 for s in samples) >= count:
            return samples
        assert time.monotonic() < deadline, f"no {name} on Ray's metrics port"
        time.sleep(1.0)


def test_the_planner_scales_up_then_in_keeping_the_cache(cluster, model_dirs):
    router = Router(cluster, model_dirs[MODEL], max_migrations=1)
    try:
        router.wait_healthy({"d0"})
        cluster.attach_router(f"http://127.0.0.1:{router.app.port}", run_loop=False)
        assert step(cluster) is None  # the first scrape opens the first window
        prompts = random_prompts(8, 40, 56, seed=7)
        first = [ask(router, p) for p in prompts[:4]]
        up = step(cluster)
        assert up is not None and up["decode"] == 2, up
        assert "decode: up 1 -> 2" in up["reasons"]
        assert status(cluster)["serving"]["decode"] == ["d0", "d1"]
        started = time.monotonic()
        router.wait_healthy({"d0", "d1"}, timeout_s=120)
        scale_up_s = time.monotonic() - started

        first += [ask(router, p) for p in prompts[4:]]
        served = {a[1].prompt_token_ids[0]: a[0].decision.decode_node for a in router.attempts}
        assert set(served.values()) == {"d0", "d1"}

        step(cluster)  # a window without traffic
        deadline = time.monotonic() + 60
        while len(status(cluster)["serving"]["decode"]) == 2:
            assert time.monotonic() < deadline, "the planner never scaled in"
            time.sleep(1.0)
            step(cluster)
        (staying,) = status(cluster)["serving"]["decode"]
        leaving = ({"d0", "d1"} - {staying}).pop()
        deadline = time.monotonic() + 90
        while not status(cluster)["retired"]:
            assert time.monotonic() < deadline, "the retired node never finished draining"
            time.sleep(0.5)
        (retired,) = status(cluster)["retired"]
        assert retired["node_id"] == leaving and retired["drained"], retired
        mine = [p for p in prompts if served[p[0]] == leaving]
        assert retired["handoff"]["prefixes"] == len(mine) and not retired["handoff"]["failed"]

        router.attempts.clear()
        again = [ask(router, p) for p in prompts]
        assert {a[0].decision.decode_node for a in router.attempts} == {staying}
        assert [a.choices[0].text for a in again] == [a.choices[0].text for a in first]
        hits = sum(a.usage.prompt_tokens_details.cached_tokens for a in again)
        before = sum((len(p) // BLOCK) * BLOCK for p in prompts)
        assert hits >= 0.9 * before - BLOCK * len(prompts), (hits, before)
        state = ray.get(ray.get_actor(f"pdcluster-{staying}").pool_state.remote(), timeout=30)
        assert state["num_held_blocks"] == 0, state
        events = wait_for_metric("ray_pdcluster_planner_scale_events_total", 2)
        assert {(e["role"], e["direction"]) for e in events} == {("decode", "up"),
                                                                  ("decode", "down")}, events
        nodes = {(n["role"], n["state"]): n["value"]
                 for n in wait_for_metric("ray_pdcluster_planner_nodes", 1)}
        assert nodes[("decode", "target")] == 1 and nodes[("prefill", "target")] == 0, nodes
        print(f"scale-up: {scale_up_s:.1f} s to a healthy second decode node")
    finally:
        router.stop()
