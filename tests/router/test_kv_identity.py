"""One KV identity, end to end: real nodes (engine, node server, registration and events) each
registering its KV identity with the real metadata service (memory backend, the cluster's
credentials), and a real router serving HTTP to the real `openai` client.

The router is given no block size: it takes the cluster's identity from the registry, hashes
prompts with it (a follow-up turn hits the blocks the nodes cached) and shows it in /health.
A node registering another block size, hash seed or tokenizer is quarantined: it gets no
request, /health names it and the fields that differ, /metrics counts it, and the others
keep serving. `router serve` refuses the flags that once set the router's own block size."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from pdcluster.cluster import cli
from pdcluster.engine.config import EngineConfig
from pdcluster.metadata_service.server import ServerThread
from pdcluster.node.config import NodeConfig
from pdcluster.node.runtime import NodeRuntime
from pdcluster.router.routing.policy import PolicyConfig
from tests.cluster_secret import TEST_CURVE, TEST_SECRET, node_credentials
from tests.metadata_service.helpers import make_config
from tests.models import random_prompts

MODEL = "llama-gqa"
BLOCK = 8  # not the 16 a router once defaulted to: a router hashing with its own would miss


def wait_for(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def admin_get(router, path: str) -> str:
    url = f"http://127.0.0.1:{router.app.admin_port}{path}"
    with urllib.request.urlopen(url, timeout=10) as reply:  # noqa: S310 (loopback)
        return reply.read().decode()


def health(router) -> dict:
    return json.loads(admin_get(router, "/health"))


def other_tokenizer(model_dir: str, out: Path) -> str:
    """A copy of the model whose tokenizer maps two words to each other's ids: same folder
    name, same weights, another tokenizer."""
    copy = out / Path(model_dir).name
    shutil.copytree(model_dir, copy)
    tokenizer = json.loads((copy / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["▁the"], vocab["▁of"] = vocab["▁of"], vocab["▁the"]
    (copy / "tokenizer.json").write_text(json.dumps(tokenizer))
    return str(copy)


@pytest.fixture
def registry():
    started: list[NodeRuntime] = []
    with ServerThread(make_config(cluster_secret=TEST_SECRET)) as server:

        def start(node_id: str, model_dir: str, **engine) -> NodeRuntime:
            options = {"num_kv_blocks": 128, "block_size": BLOCK, **engine}
            node = NodeRuntime(NodeConfig(
                node_id=node_id, role="decode", metadata_address=server.address,
                lease_ttl_s=5, engine=EngineConfig(model_dir, **options),
                publish_interval_s=0.02, **node_credentials(node_id)),
                shared_keys=TEST_CURVE).start()
            started.append(node)
            return node

        try:
            yield server, start
        finally:
            for node in started:
                node.stop(drain=False)


def test_nodes_with_another_kv_identity_are_quarantined(registry, start_router, model_dirs,
                                                        tmp_path) -> None:
    server, start = registry
    good = start("good", model_dirs[MODEL])
    # round robin: without the quarantine, every decode node would get every fourth request
    router = start_router(metadata_address=server.address, model_dir=model_dirs[MODEL],
                          routing="round_robin", admin_port=0)
    dispatcher = router.app.dispatcher
    wait_for(lambda: "good" in dispatcher.nodes, "the router to find the first node")
    bad = {"bad-block": start("bad-block", model_dirs[MODEL], block_size=16),
           "bad-seed": start("bad-seed", model_dirs[MODEL], hash_seed="another-seed"),
           "bad-tokenizer": start("bad-tokenizer", other_tokenizer(model_dirs[MODEL], tmp_path))}
    # every registered node seen by the router: routed to, or quarantined
    wait_for(lambda: set(health(router)["nodes"]) | set(health(router).get("quarantined", {}))
             == {"good", *bad}, "the router to see every node")

    client = openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0, timeout=60)
    for prompt in random_prompts(8, 20, 40, seed=3):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=3)
        assert out.choices[0].text is not None and out.usage.completion_tokens >= 1
    assert {name: node.server.stats.num_requests for name, node in bad.items()} \
        == dict.fromkeys(bad, 0)
    assert good.server.stats.num_requests == 8
    assert set(dispatcher.nodes) == {"good"}

    body = health(router)
    assert body["status"] == "ok"
    assert body["kv_identity"]["block_size"] == BLOCK
    assert body["kv_identity"]["source"] == "node good"
    assert body["router_tokenizer_digest"] == body["kv_identity"]["tokenizer_digest"]
    quarantined = {n: q["mismatch"] for n, q in body["quarantined"].items()}
    assert quarantined == {"bad-block": ["block_size"], "bad-seed": ["hash_seed"],
                           "bad-tokenizer": ["tokenizer_digest"]}
    assert "another-seed" in body["quarantined"]["bad-seed"]["reason"]
    metrics = admin_get(router, "/metrics")
    assert "router_quarantined_nodes 3.0" in metrics
    assert 'router_node_quarantined{mismatch="hash_seed",node="bad-seed"} 1.0' in metrics


def test_a_router_with_no_block_size_routes_by_the_registry(registry, start_router,
                                                            model_dirs) -> None:
    server, start = registry
    for name in ("n0", "n1"):
        start(name, model_dirs[MODEL])
    # no block size anywhere in the router's config; no balance term: the follow-up goes
    # where its prefix is, nothing else
    router = start_router(metadata_address=server.address, model_dir=model_dirs[MODEL],
                          policy=PolicyConfig(balance_slack=10.0, balance_tilt=0.0), seed=0,
                          admin_port=0)
    dispatcher = router.app.dispatcher
    wait_for(lambda: {"n0", "n1"} <= set(dispatcher.nodes)
             and all(n.healthy for n in dispatcher.nodes.values())
             and dispatcher.metadata.mirror_in_sync, "the router to find the nodes")
    client = openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0, timeout=60)
    prompt = random_prompts(1, 44, 44, seed=11)[0]  # 5 blocks of 8 and 4 tokens
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    wait_for(lambda: 5 in dispatcher.metadata.mirror_node_blocks().values(),
             "the holder's blocks in the router's mirror")
    holder = next(n for n, k in dispatcher.metadata.mirror_node_blocks().items() if k == 5)

    def idle() -> bool:  # a load report from after the request (its load is gone)
        link = dispatcher.nodes[holder]
        return (link.num_inflight == 0 and link.report is not None
                and link.report.num_running == 0 and link.pending_tokens == 0
                and link.report.queued_prefill_tokens == 0)
    wait_for(idle, "the holder's load report to settle")
    client.completions.create(model="tiny", prompt=prompt + [5, 6, 7, 8], max_tokens=2)
    hits = router.app.metrics.registry.get_sample_value("router_prefix_hit_tokens_total")
    assert hits == 5 * BLOCK  # the router's hashes of the prompt are the nodes' blocks
    identity = health(router)["kv_identity"]
    assert (identity["block_size"], identity["hash_algorithm"], identity["model"]) \
        == (BLOCK, "sha256", MODEL)


@pytest.mark.parametrize("flag", [["--block-size", "16"], ["--engine", "vllm"]])
def test_router_serve_refuses_a_block_size_of_its_own(flag: list[str], capsys) -> None:
    parser = cli.build_parser()
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["router", "serve", "--model", "m", "--metadata", "x:1", *flag])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag[0]} is not the router's to set" in err and "KV identity" in err
