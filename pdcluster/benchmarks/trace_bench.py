"""Live trace benchmark: `pdcluster bench trace --trace FILE.jsonl [--json]`.

Replays a slice of a Mooncake trace (benchmarks/trace_workload.py: block ids become
deterministic token blocks, scaled down; arrival times scaled by `--time-scale`) against a
live local cluster — Ray, `--num-prefill` prefill and `--num-decode` decode node actors, the
embedded metadata service, the router — through the router's HTTP API (streaming
/v1/completions with token-id prompts), once per routing policy (`kv`, `round_robin`,
`least_loaded`; `RouterConfig.routing`). One cluster serves every policy: before each, every
node empties its prefix cache (`NodeActor.reset_prefix_cache`; the metadata service's index
and the new router's mirror of it follow, and the run waits until the index is empty) and a
fresh router starts, so no cached block and no routing memory survives from one policy to
the next. A round-robin warm-up before the first policy opens every prefill -> decode
connection (the first transfer to a peer costs a connection set-up), so no policy pays it.

Per policy: TTFT and end-to-end latency p50/p90 (client side), output tokens/s over the run,
completed and failed requests, and from the nodes' own Prometheus metrics (node/metrics.py,
scraped over HTTP before and after the run; the figures are the differences): the prefix
hit ratio over the prompts the nodes computed — `local_hit_ratio` (tokens their own prefix
cache held) and `prefix_hit_ratio` (those plus the tokens pulled from another node: global
prefix reuse) — KV blocks transferred P->D and blocks pulled between nodes. Beside them,
`pdcluster replay`'s prediction for the same slice (router.sim.replay, `--num-prefill` nodes, the
prefill nodes' cache in trace blocks), and the headline figures:
`ttft_p50_ratio_kv_vs_round_robin` and `live_vs_replay_hit_ratio` (kv's live
`prefix_hit_ratio` over the replay's `hit_ratio`).

KV tiers (`--host-blocks M`): the same slice again on a second cluster whose nodes hold a host
tier of M blocks below their `--kv-blocks` device blocks (`EngineConfig.num_host_blocks`), with
the `kv` policy, so one run shows what the tier buys at small device pools: `with_host_tier`
(that run's figures; a host hit counts in `prefix_hit_tokens` like a device hit, and the replay's
prediction with the same tier) and the headlines `hit_ratio_host_tier_vs_none` and
`ttft_p50_ratio_host_tier_vs_none` (kv with the tier over kv without, same run).

The model: `--model DIR` (e.g. the built-in SmolLM2), or by default a random `tiny` model
built for the run (its tokens are gibberish, its compute is real).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from pdcluster.benchmarks.trace_workload import (
    TRACE_BLOCK_TOKENS,
    TraceRequest,
    Workload,
    load_workload,
    predict_hit_ratios,
)

POLICIES = ("kv", "round_robin", "least_loaded")
BLOCK_SIZE = 16  # the nodes' KV block size, in tokens


def run(args: argparse.Namespace) -> dict:
    policies = tuple(p for p in args.policies.split(",") if p)
    if not policies or any(p not in POLICIES for p in policies):
        raise ValueError(f"--policies must name some of {', '.join(POLICIES)}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pdcluster-trace-bench-") as tmp:
        model = args.model or _tiny_model(tmp)
        workload = load_workload(args.trace, args.offset, args.limit, args.tokens_per_block,
                                 args.time_scale, args.max_output_tokens, _vocab_size(model))
        cache_trace_blocks = (args.num_prefill * args.kv_blocks * BLOCK_SIZE
                              // args.tokens_per_block)
        config = _cluster_config(args, model)
        predicted = predict_hit_ratios(workload, max(args.num_prefill, 1),
                                       cache_trace_blocks, policies,
                                       config.global_reuse_min_tokens)
        live = _run_policies(args, config, workload, policies)
        tiers = _run_with_host_tier(args, model, workload) if args.host_blocks else None
    result = _report(args, model, workload, predicted, live, time.perf_counter() - started)
    if tiers is not None:
        result.update(_tier_headlines(live.get("kv"), tiers))
        result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def _run_with_host_tier(args: argparse.Namespace, model: str, workload: Workload) -> dict:
    """The `kv` policy on a cluster whose nodes hold `--host-blocks` below their device pool,
    beside the replay's prediction for the same tiers (trace blocks per node)."""
    config = _cluster_config(args, model, host_blocks=args.host_blocks)
    nodes = max(args.num_prefill, 1)
    device = max(1, args.kv_blocks * BLOCK_SIZE // args.tokens_per_block)
    host = args.host_blocks * BLOCK_SIZE // args.tokens_per_block
    predicted = predict_hit_ratios(workload, nodes, nodes * device, ("kv",),
                                   config.global_reuse_min_tokens, device_blocks=device,
                                   host_blocks=host)
    figures = _run_policies(args, config, workload, ("kv",))["kv"]
    figures["replay_hit_ratio"] = predicted["kv"]["hit_ratio"]
    figures["replay_reuse_ratio"] = predicted["kv"]["reuse_ratio"]
    return {"host_blocks_per_node": args.host_blocks, "kv": figures}


def _tier_headlines(kv: dict | None, tiers: dict) -> dict:
    with_tier = tiers["kv"]
    out: dict = {"with_host_tier": tiers}
    if kv and kv["prefix_hit_ratio"] > 0:
        out["hit_ratio_host_tier_vs_none"] = round(with_tier["prefix_hit_ratio"]
                                                   / kv["prefix_hit_ratio"], 3)
    if kv and kv["ttft_p50_ms"] > 0:
        out["ttft_p50_ratio_host_tier_vs_none"] = round(with_tier["ttft_p50_ms"]
                                                        / kv["ttft_p50_ms"], 3)
    return out


def _tiny_model(tmp: str) -> str:
    from pdcluster.engine.models.tiny_model import make_tiny_model

    return str(make_tiny_model(Path(tmp) / "tiny", preset="tiny",
                               max_position_embeddings=8192))


def _vocab_size(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def _cluster_config(args: argparse.Namespace, model: str, host_blocks: int = 0):
    from pdcluster.cluster.config import ClusterConfig

    engine = {"block_size": BLOCK_SIZE, "num_kv_blocks": args.kv_blocks,
              "max_num_batched_tokens": 2048}
    if host_blocks:
        engine["num_host_blocks"] = host_blocks
    return ClusterConfig(model=model, num_prefill=args.num_prefill,
                         num_decode=args.num_decode, node_metrics_port=0, engine=engine)


def _run_policies(args: argparse.Namespace, config, workload: Workload,
                  policies: tuple[str, ...]) -> dict[str, dict]:
    """One cluster; per policy a fresh router, after every node's prefix cache was reset."""
    from pdcluster.cluster.launch import router_config
    from pdcluster.cluster.ray_cluster import RayCluster

    cluster = RayCluster(config).start()
    try:
        nodes = cluster.nodes()
        assert cluster.cluster_secret is not None, "an embedded cluster makes its own secret"
        # a node answers load polls between engine steps: on a small, saturated CPU a step
        # can outlast the default 2 s timeout, and the router would take the node for dead
        base = dataclasses.replace(
            router_config(config, cluster.metadata_address, cluster.cluster_secret), port=0,
            node_timeout_s=args.node_timeout)
        _run_router(dataclasses.replace(base, routing="round_robin"), _warm_up(args, workload),
                    len(nodes), args.request_timeout)
        results = {}
        for policy in policies:
            _reset_caches(cluster)
            before = _node_totals(nodes)
            client = _run_router(dataclasses.replace(base, routing=policy), workload.requests,
                                 len(nodes), args.request_timeout)
            results[policy] = {**client, **_node_figures(before, _node_totals(nodes))}
        return results
    finally:
        cluster.stop()


def _warm_up(args: argparse.Namespace, workload: Workload) -> list[TraceRequest]:
    """Requests that open every prefill -> decode connection once (round-robin), with prompts
    of tokens no trace block uses, so they leave nothing a trace request could hit."""
    count = 2 * max(args.num_prefill, 1) * args.num_decode
    length = 2 * args.tokens_per_block + 1
    return [TraceRequest(0.0, [3 + (i % 5)] * length, 2, 0) for i in range(count)]


def _reset_caches(cluster, timeout_s: float = 60.0) -> None:
    """Every node's prefix cache emptied; retried while a node still finishes work."""
    import ray

    deadline = time.monotonic() + timeout_s
    pending = dict(cluster.actors)
    while pending:
        done = ray.get([a.reset_prefix_cache.remote() for a in pending.values()])
        pending = {n: a for (n, a), ok in zip(pending.items(), done, strict=True) if not ok}
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"nodes {sorted(pending)} stayed busy: caches not reset")
        time.sleep(0.2 if pending else 0.0)


def _run_router(config, requests: list[TraceRequest], num_nodes: int,
                timeout_s: float) -> dict:
    return asyncio.run(_serve_and_replay(config, requests, num_nodes, timeout_s))


async def _serve_and_replay(config, requests: list[TraceRequest], num_nodes: int,
                            timeout_s: float) -> dict:
    import aiohttp

    from pdcluster.benchmarks.trace_client import client_figures, timed_request, wait_ready
    from pdcluster.router.api.server import RouterApp

    app = RouterApp(config)
    await app.start()
    base = f"http://{config.host}:{app.port}"
    try:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, base, num_nodes)
            started = time.perf_counter()
            results = await asyncio.gather(*(
                timed_request(session, base, app.model_name, req, started, timeout_s)
                for req in requests))
            wall_s = time.perf_counter() - started
    finally:
        await app.stop()
    return client_figures(results, wall_s)


def _node_totals(nodes: list[dict]) -> dict[str, float]:
    """The scraped figures (`_SCRAPED`) summed over the nodes."""
    totals: dict[str, float] = {}
    for node in nodes:
        for key, value in scrape(node["metrics_address"]).items():
            totals[key] = totals.get(key, 0.0) + value
    return totals


def _node_figures(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the nodes' counters moved by during one policy's run: hit ratios, blocks moved."""
    moved = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}
    queried = moved.get("prefix_queried_tokens", 0.0)
    hit = moved.get("prefix_hit_tokens", 0.0)
    pulled = moved.get("blocks_pulled", 0.0)
    return {"prefix_queried_tokens": int(queried), "prefix_hit_tokens": int(hit),
            "local_hit_ratio": round(hit / queried, 4) if queried else 0.0,
            "prefix_hit_ratio": round((hit + pulled * BLOCK_SIZE) / queried, 4)
            if queried else 0.0,
            "blocks_transferred_p_to_d": int(moved.get("blocks_sent", 0.0)),
            "blocks_pulled": int(pulled), "preemptions": int(moved.get("preemptions", 0.0))}


_SCRAPED = {("pdcluster_node_prefix_queried_tokens_total", None): "prefix_queried_tokens",
            ("pdcluster_node_prefix_hit_tokens_total", None): "prefix_hit_tokens",
            ("pdcluster_node_preemptions_total", None): "preemptions",
            ("pdcluster_node_kv_blocks_total", "sent"): "blocks_sent",
            ("pdcluster_node_kv_blocks_total", "pulled"): "blocks_pulled"}


def scrape(address: str) -> dict[str, float]:
    """The figures of one node's /metrics this benchmark reports (`_SCRAPED`)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(address, timeout=10) as reply:
        text = reply.read().decode()
    figures = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = _SCRAPED.get((sample.name, sample.labels.get("direction")))
            if name is not None:
                figures[name] = sample.value
    return figures


def _report(args: argparse.Namespace, model: str, workload: Workload, predicted: dict,
            live: dict[str, dict], wall_s: float) -> dict:
    for policy, figures in live.items():
        figures["replay_hit_ratio"] = predicted[policy]["hit_ratio"]
        figures["replay_reuse_ratio"] = predicted[policy]["reuse_ratio"]
        figures["replay_work_imbalance"] = predicted[policy]["work_imbalance"]
    result = {
        "trace": str(args.trace), "offset": args.offset, "requests": len(workload.requests),
        "model": Path(model).name if args.model else "tiny (random weights, built for the run)",
        "num_prefill": args.num_prefill, "num_decode": args.num_decode,
        "kv_blocks_per_node": args.kv_blocks, "block_size": BLOCK_SIZE,
        "trace_block_tokens": TRACE_BLOCK_TOKENS, "tokens_per_trace_block": args.tokens_per_block,
        "prompt_tokens_mean": round(statistics.mean(len(r.prompt) for r in workload.requests), 1),
        "max_output_tokens": args.max_output_tokens, "time_scale": args.time_scale,
        "node_timeout_s": args.node_timeout,
        "offered_requests_per_s": round(len(workload.requests) / workload.duration_s, 3)
        if workload.duration_s else None,
        "ideal_hit_ratio": predicted["ideal_hit_ratio"], "policies": live,
        "wall_s": round(wall_s, 1)}
    kv, rr = live.get("kv"), live.get("round_robin")
    if kv and rr and rr["ttft_p50_ms"] > 0:
        result["ttft_p50_ratio_kv_vs_round_robin"] = round(kv["ttft_p50_ms"] / rr["ttft_p50_ms"],
                                                           3)
    if kv and kv["replay_reuse_ratio"]:
        result["live_vs_replay_hit_ratio"] = round(kv["prefix_hit_ratio"]
                                                   / kv["replay_reuse_ratio"], 3)
    return result
